"""The off-policy sequence mask (TRL's ``off_policy_mask_threshold``) in the reference and every backend.

The reference's mask is held against TRL 1.16's own ``GRPOTrainer.get_off_policy_mask`` and against
its definition (the PG term of the dropped rows removed, nothing else); the CPU and Triton backends
are then held against the float64 reference with rows on both sides of the threshold.
"""

from __future__ import annotations

import parity
import pytest
import torch
from parity import make_problem
from stage_harness import stage

from sage_kernels import LossConfig, fused_linear_sage_loss
from sage_kernels.reference import off_policy_keep

F64 = torch.float64


def behaviour_problem(seed, *, sampling=True, nan=True, **present):
    """A loss problem whose sampler log-probs sit far from the policy in some rows only, so the
    threshold 0.5 drops some negative-advantage rows and keeps others."""
    problem = make_problem(B=4, L=9, V=200, D=32, seed=seed, mask="tail", **present)
    g = torch.Generator().manual_seed(seed)
    B, L = problem["mask"].shape
    base = problem["old_logp"] if problem["old_logp"] is not None else problem["ref_logp"]
    shift = torch.tensor([2.0, 0.0, 2.0, 0.0])[:, None]  # rows 0 and 2 far from the policy, 1 and 3 near
    far = base + shift + 0.1 * torch.randn(B, L, generator=g)
    if sampling:
        if nan:
            far[0, 0] = float("nan")  # a token the sampler could not score
        problem["sampling_logp"] = far.float()
    elif problem["old_logp"] is not None:
        problem["old_logp"] = far.float()
    problem["advantages"] = torch.tensor([-1.0, -0.5, 0.8, -1.2])
    return problem


def test_the_mask_is_trls():
    trl = pytest.importorskip("trl")
    g = torch.Generator().manual_seed(0)
    B, L = 6, 7
    logp = -torch.rand(B, L, generator=g, dtype=F64) * 3
    sampling = logp + torch.randn(B, L, generator=g, dtype=F64)
    sampling[1, 2] = float("nan")
    mask = torch.rand(B, L, generator=g) > 0.3
    A = torch.randn(B, 1, generator=g, dtype=F64)
    for threshold in (0.0, 0.3, 1.0):
        theirs = trl.GRPOTrainer.get_off_policy_mask(A, logp, sampling, mask.to(F64), threshold)
        ours = off_policy_keep(logp, sampling, A.expand(B, L), mask, threshold)
        assert torch.equal(ours, theirs.bool().expand(B, L)), threshold


def test_a_hand_made_case():
    logp = torch.zeros(3, 4, dtype=F64)
    sampling = torch.zeros(3, 4, dtype=F64)
    logp[0], logp[1], logp[2] = -2.0, -0.5, -2.0  # mean KL 2, 0.5, 2
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 2:] = False
    logp[2, 2:] = 1e4  # padding: never read
    A = torch.tensor([[1.0], [-1.0], [-1.0]], dtype=F64).expand(3, 4)
    keep = off_policy_keep(logp, sampling, A, mask, 1.0)
    assert keep.all(-1).tolist() == [True, True, False] and keep.any(-1).tolist() == [True, True, False]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "sapo"])
def test_it_drops_the_pg_term_of_the_masked_rows_only(loss_type):
    """With the mask on, the loss equals the loss whose PG term is multiplied by the kept rows
    (is_weights), the KL and entropy terms unchanged."""
    g = torch.Generator().manual_seed(1)
    B, L = 4, 5
    logp = -torch.rand(B, L, generator=g, dtype=F64) * 3
    old = logp + torch.tensor([1.5, 0.0, 1.5, 0.1], dtype=F64)[:, None]
    A = [-1.0, -1.0, 0.5, -0.3]
    common = dict(old_logp=old, ref_logp=logp + 0.3, loss_type=loss_type, beta=0.1, entropy_coef=0.05, guide="none")
    batch = (logp, torch.rand(B, L, generator=g, dtype=F64), torch.ones(B, L), A)
    masked, _, _, _ = stage(*batch, off_policy_mask_threshold=1.0, **common)
    keep = torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=F64)[:, None].expand(B, L)  # row 0: A < 0 and KL 1.5
    weighted, _, _, _ = stage(*batch, is_weights=keep, **common)
    assert torch.allclose(masked, weighted, atol=1e-12, rtol=0)
    unmasked, _, _, _ = stage(*batch, **common)
    assert not torch.allclose(masked, unmasked)


CASES = {
    "grpo-sampling-nan": (dict(loss_type="grpo"), dict(sampling=True)),
    "dapo-sequence-old": (dict(loss_type="dapo", importance_sampling="sequence"), dict(sampling=False)),
    "vespo-sampling-is_weights": (dict(loss_type="vespo"), dict(sampling=True, is_weights=True)),
    "cispo-quantile-per_token_adv": (
        dict(loss_type="cispo", eps_high=1.5, top_entropy_quantile=0.6, entropy_coef=0.02),
        dict(sampling=True, adv_per_token=True),
    ),
    "bnpo-on_policy-sampling": (dict(loss_type="bnpo"), dict(sampling=True, old=False)),
}


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("backend", ["cpu-native", "cpu-torch", "triton"])
def test_backends_match_the_reference(backend, name):
    options, present = CASES[name]
    problem = behaviour_problem(len(name), **present)
    if present.get("adv_per_token"):
        problem["advantages"] = problem["advantages"][:, None] * torch.linspace(0.5, 1.5, 9)
        problem["advantages"][1, :3] = 0.7  # a row with tokens of both signs
    config = LossConfig(beta=0.2, guide="branch", off_policy_mask_threshold=0.5, **options)
    native = {"cpu-native": True, "cpu-torch": False}.get(backend)
    parity.check_against_reference(problem, config, backend.split("-")[0], torch.float32, native=native, seed=3)


def test_the_threshold_decides_which_rows_lose_their_pg_term():
    """The fixture drops rows 0 (far, A < 0) and keeps 1 (near), 2 (A > 0) and 3 (near): the
    loss moves with the threshold, and a threshold above every row's KL is no mask at all."""
    problem = behaviour_problem(0, nan=False)

    def loss(threshold):
        config = LossConfig(beta=0.0, guide="none", off_policy_mask_threshold=threshold)
        keys = ("bias", "old_logp", "ref_logp", "sampling_logp")
        inputs = {k: problem[k] for k in keys}
        args = (problem[k] for k in ("hidden", "weight", "token_ids", "mask", "advantages"))
        return fused_linear_sage_loss(*args, **inputs, config=config, backend="reference").loss

    none = fused_linear_sage_loss(
        *(problem[k] for k in ("hidden", "weight", "token_ids", "mask", "advantages")),
        bias=problem["bias"],
        old_logp=problem["old_logp"],
        config=LossConfig(beta=0.0, guide="none"),
        backend="reference",
    ).loss
    assert torch.equal(loss(100.0), none)
    assert not torch.allclose(loss(0.5), none)


@pytest.mark.parametrize("threshold", [-0.1, float("nan"), float("inf"), "0.5"], ids=str)
def test_a_bad_threshold_raises(threshold):
    with pytest.raises(ValueError, match="off_policy_mask_threshold"):
        LossConfig(off_policy_mask_threshold=threshold)


def test_sampling_logp_must_be_b_by_l():
    problem = behaviour_problem(0)
    with pytest.raises(ValueError, match="sampling_logp must have shape"):
        fused_linear_sage_loss(
            *(problem[k] for k in ("hidden", "weight", "token_ids", "mask", "advantages")),
            ref_logp=problem["ref_logp"],
            sampling_logp=problem["sampling_logp"][:, :-1],
            off_policy_mask_threshold=0.5,
        )
