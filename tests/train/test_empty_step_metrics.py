"""A step without completion tokens has no metric values: NaN out of the loss, left out of the
micro-batch sums, NaN-skipped across ranks, and absent from the logged row (not a 0 or a 1)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sage_kernels import LossConfig, fused_linear_sage_loss
from sage_train.distributed import reduce_rows
from sage_train.report import MetricsLog, progress_postfix
from sage_train.step import LossTotals

TOKEN_MEANS = ("kl", "entropy", "sage/q_mean", "sage/frac_q_gt_1")


def micro_batch(seed: int, empty: bool):
    g = torch.Generator().manual_seed(seed)
    B, L, V, H = 2, 5, 11, 8
    mask = torch.zeros(B, L, dtype=torch.bool) if empty else torch.rand(B, L, generator=g) > 0.3
    out = fused_linear_sage_loss(
        torch.randn(B, L, H, generator=g),
        torch.randn(V, H, generator=g),
        torch.randint(0, V, (B, L), generator=g),
        mask,
        torch.randn(B, generator=g),
        ref_logp=-torch.rand(B, L, generator=g),
        config=LossConfig(guide="branch", tau=0.5),
        backend="reference",
    )
    return out, mask


def test_an_empty_micro_batch_adds_nothing_to_the_step():
    full, full_mask = micro_batch(0, empty=False)
    empty, empty_mask = micro_batch(1, empty=True)
    assert all(torch.isnan(v) for v in empty.metrics.values())
    alone, mixed = LossTotals(), LossTotals()
    alone.add(full.loss, full, full_mask)
    for out, mask in ((empty, empty_mask), (full, full_mask), (empty, empty_mask)):
        mixed.add(out.loss, out, mask)
    a, m = alone.metrics(1), mixed.metrics(1)
    for name in (*TOKEN_MEANS, "sage/q_min", "sage/q_max"):
        assert torch.isfinite(torch.as_tensor(m[name])), name
        assert torch.equal(torch.as_tensor(m[name]), torch.as_tensor(a[name])), name


def test_a_step_without_tokens_has_no_token_means():
    totals = LossTotals()
    for seed in (1, 2):
        out, mask = micro_batch(seed, empty=True)
        totals.add(out.loss, out, mask)
    metrics = totals.metrics(2)
    for name in (*TOKEN_MEANS, "sage/q_min", "sage/q_max"):
        assert torch.isnan(torch.as_tensor(metrics[name])), name
    assert float(metrics["loss"]) == 0.0


def test_the_logged_row_leaves_out_what_has_no_value(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write([{"step": 1, "loss": 0.0, "kl": math.nan, "sage/q_mean": math.nan, "reward": 0.5}])
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    row = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert row == {"step": 1, "loss": 0.0, "reward": 0.5}
    assert progress_postfix({"reward": 0.5, "kl": math.nan, "sage/q_mean": math.nan}) == "reward=0.500"


def _two_ranks(rank: int, init_file: str, queue) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    # rank 1 had no completion token at step 1; neither had one for q_mean at step 2
    steps = {
        1: [
            dict(kl=0.2, **{"sage/q_min": 0.9, "sage/q_max": 1.4}),
            dict(kl=math.nan, **{"sage/q_min": math.nan, "sage/q_max": math.nan}),
        ],
        2: [dict(kl=math.nan, **{"sage/q_min": math.nan, "sage/q_max": math.nan})] * 2,
    }
    pending = [(step, ranks[rank]) for step, ranks in steps.items()]
    rows = reduce_rows(pending, torch.device("cpu"))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def test_ranks_without_tokens_are_left_out_of_the_mean(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_two_ranks, args=(str(tmp_path / "init"), queue), nprocs=2, start_method="spawn")
    first, second = queue.get()
    assert first == {
        "step": 1,
        "kl": pytest.approx(0.2),
        "sage/q_min": pytest.approx(0.9),
        "sage/q_max": pytest.approx(1.4),
    }
    assert second["step"] == 2 and all(math.isnan(second[k]) for k in ("kl", "sage/q_min", "sage/q_max"))
