"""The anchor's per-token pressure (`pressure/anchor_to_task`, `pressure/guide_to_task`), logged by
every run with a KL in its loss: from the real loss's per-token outputs, against k3's closed form."""

import pytest
import torch

from sage_kernels import LossConfig, fused_linear_sage_loss
from sage_train.step import LossTotals


def loss_and_inputs(config: LossConfig, seed: int = 0):
    torch.manual_seed(seed)
    B, L, H, V = 4, 6, 8, 11
    mask = torch.rand(B, L) < 0.8
    inputs = dict(
        hidden=torch.randn(B, L, H),
        weight=torch.randn(V, H),
        token_ids=torch.randint(0, V, (B, L)),
        mask=mask,
        advantages=torch.randn(B),
        ref_logp=-3 * torch.rand(B, L),
    )
    out = fused_linear_sage_loss(**inputs, config=config, backend="reference")
    return out, {**inputs, "old_logp": None}


def test_pressure_is_the_anchors_and_the_guides_pull_over_the_tasks():
    config = LossConfig(guide="branch", tau=1.5, beta=0.2)
    out, inputs = loss_and_inputs(config)
    mask = inputs["mask"]
    assert 0 < ((out.q > 1) & mask).sum() < mask.sum()  # the guide raises some tokens, not all
    totals = LossTotals()
    for _ in range(2):  # two micro-batches add up: the ratio of the sums is the same
        totals.add(out.loss, out, mask)
        totals.add_pressure(out, inputs, config)
    metrics = totals.metrics(1)
    # k3 of the KL to q pi_ref: its coefficient on log pi is beta (1 - q pi_ref / pi); at q = 1,
    # beta (1 - pi_ref / pi); the task's is A times the ratio (1 on-policy)
    to_ref = torch.exp(inputs["ref_logp"] - out.logp)
    task = (inputs["advantages"][:, None].abs() * torch.ones_like(to_ref))[mask].sum()
    anchor = (0.2 * (1 - out.q * to_ref)).abs()[mask].sum()
    guide = (0.2 * (out.q - 1) * to_ref).abs()[mask].sum()
    assert float(metrics["pressure/anchor_to_task"]) == pytest.approx(float(anchor / task), rel=1e-5)
    assert float(metrics["pressure/guide_to_task"]) == pytest.approx(float(guide / task), rel=1e-5)
    assert 0 < float(metrics["pressure/guide_to_task"]) < float(metrics["pressure/anchor_to_task"])


def test_without_a_guide_its_part_is_zero_and_without_kl_nothing_is_logged():
    plain = LossConfig(guide="none", beta=0.05)  # GRPO: q = 1
    out, inputs = loss_and_inputs(plain, seed=1)
    totals = LossTotals()
    totals.add_pressure(out, inputs, plain)
    metrics = totals.metrics(1)
    assert float(metrics["pressure/guide_to_task"]) == 0.0 and float(metrics["pressure/anchor_to_task"]) > 0
    without = LossConfig(guide="none", beta=0.0)
    out, inputs = loss_and_inputs(without, seed=1)
    totals = LossTotals()
    totals.add_pressure(out, inputs, without)
    assert not any(name.startswith("pressure/") for name in totals.metrics(1))
