"""`luspo_include_padding`: luspo as Liger 0.8.5 and TRL <= 1.15 aggregate it.

loss = Σ_b Σ_t l_bt n_b / (B L), every position t < L included, n_b the row's token count; the
default stays TRL 1.16's Σ_b Σ_t m_bt l_bt / B. The float64 reference is held against Liger's own
per-token GRPO maths and against both aggregations written out from a per-token loss built here;
then every backend is held against the reference on padded batches, gradients included.
"""

from __future__ import annotations

import parity
import pytest
import torch
from far_cases import far_batch, far_problem, liger_loss
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from stage_harness import max_rel_err, stage

from sage_kernels import LossConfig, fused_linear_sage_loss
from sage_kernels.triton.three_matmul import PATHS_TAKEN

F64 = torch.float64
BETA = 0.1  # liger_loss's


def stage_of(batch, *, vllm=False, **options):
    """The reference's per-token stage on `batch` with Liger's settings (guide off, beta 0.1)."""
    mask = batch["mask"].bool()
    return stage(
        batch["logp"],
        batch["entropy"],
        batch["mask"],
        batch["advantages"],
        old_logp=batch["old_logp"],
        ref_logp=batch["ref_logp"],
        # liger_loss hands Liger weights of 1 at padded positions: the same values here
        is_weights=torch.where(mask, batch["is_weights"], 1.0) if vllm else None,
        guide="none",
        beta=BETA,
        **options,
    )


@pytest.mark.parametrize("bias_kl", [False, True], ids=["kl", "bias_kl"])
@pytest.mark.parametrize("vllm", [False, True], ids=["plain", "vllm_is"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_reference_matches_liger_on_padded_rows(level, vllm, bias_kl):
    pytest.importorskip("liger_kernel")
    options = dict(loss_type="luspo", importance_sampling=level, use_bias_correction_kl=bias_kl)
    batch = far_batch(seed=11)
    padded = batch["mask"] == 0
    assert padded.any() and (padded.sum(-1) < padded.shape[1]).all(), "padding inside rows that have tokens"
    want_loss, want_grad, want_metrics = liger_loss(batch, options, vllm=vllm)
    loss, per_token, logp, _ = stage_of(batch, vllm=vllm, luspo_include_padding=True, **options)
    (grad,) = torch.autograd.grad(loss, logp)
    assert abs(loss.item() - want_loss.item()) <= 1e-12 * max(abs(want_loss.item()), 1.0)
    assert max_rel_err(grad, want_grad) <= 1e-12  # at every position, padded ones included
    assert grad[padded].abs().min() > 0, "padded positions carry gradient under this aggregation"
    assert per_token["metrics"]["kl"].item() == pytest.approx(want_metrics[0].item(), rel=1e-12)
    assert per_token["metrics"]["clip_ratio/region_mean"].item() == pytest.approx(want_metrics[1].item(), abs=1e-15)
    # and the default differs from Liger here (the KL term makes the per-token loss [B, L])
    default_loss, _, _, _ = stage_of(batch, vllm=vllm, **options)
    assert abs(default_loss.item() - want_loss.item()) > 1e-3


def per_token_loss(batch, level):
    """PPO's clipped surrogate plus beta * k3, per position, from the formulas of docs/loss.md."""
    mask = batch["mask"]
    log_ratio = batch["logp"] - batch["old_logp"]
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)).expand_as(
            mask
        )
    ratio = log_ratio.exp()
    A = batch["advantages"][:, None]
    pg = -torch.minimum(ratio * A, ratio.clamp(0.8, 1.2) * A)
    delta = batch["ref_logp"] - batch["logp"]
    return pg + BETA * (delta.exp() - delta - 1.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_both_aggregations_as_trl_writes_them(level):
    batch = far_batch(seed=5)
    mask = batch["mask"]
    loss_by_token = per_token_loss(batch, level)
    liger_form, _, _ = liger_loss(batch, dict(loss_type="luspo", importance_sampling=level), vllm=False)
    trl_115 = (loss_by_token * mask.sum(-1, keepdim=True)).mean()  # TRL <= 1.15, Liger 0.8.5
    trl_116 = (loss_by_token * mask).sum(-1).mean()  # TRL 1.16
    assert trl_115.item() == pytest.approx(liger_form.item(), rel=1e-12), "the per-token loss written here is Liger's"
    padded, _, _, _ = stage_of(batch, loss_type="luspo", importance_sampling=level, luspo_include_padding=True)
    default, _, _, _ = stage_of(batch, loss_type="luspo", importance_sampling=level)
    assert padded.item() == pytest.approx(trl_115.item(), rel=1e-12)
    assert default.item() == pytest.approx(trl_116.item(), rel=1e-12)
    assert abs(trl_115.item() - trl_116.item()) > 1e-3


def test_agrees_with_the_default_where_the_per_token_loss_is_constant_along_rows():
    # sequence-level ratios, beta = 0, no per-token weights: l_bt = l_b, and Σ_t l_b n_b / L = n_b l_b
    batch = far_batch(seed=2)
    values = (batch["logp"], batch["entropy"], batch["mask"], batch["advantages"])
    options = dict(
        old_logp=batch["old_logp"], guide="none", loss_type="luspo", importance_sampling="sequence", beta=0.0
    )
    padded, _, _, _ = stage(*values, luspo_include_padding=True, **options)
    default, _, _, _ = stage(*values, **options)
    assert padded.item() == pytest.approx(default.item(), rel=1e-12)


# ---------------------------------------------------------------- the backends against the reference


CASES = {
    "sequence-kl": dict(importance_sampling="sequence"),
    "sequence-bias_kl-branch": dict(importance_sampling="sequence", use_bias_correction_kl=True, guide="branch"),
    "token-kl": dict(),
    "token-entropy-quantile-delta": dict(entropy_coef=0.02, top_entropy_quantile=0.6, delta_clip=1.5),
}


def assert_padded_rows_have_gradient(problem, grad_hidden):
    """Padded positions of rows with tokens get gradient; rows without tokens (weight n_b = 0) get none."""
    mask = problem["mask"].bool()
    per_row = grad_hidden.reshape(mask.shape + (-1,)).abs().amax(-1)
    with_tokens = mask.any(-1, keepdim=True).expand_as(mask)
    assert bool((per_row[~mask & with_tokens] > 0).all())
    assert bool((per_row[~with_tokens] == 0).all())


@pytest.mark.parametrize("mask", ["tail", "random"])
@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("backend", ["cpu-native", "cpu-torch", "triton"])
def test_backends_match_the_reference(backend, name, mask):
    problem = far_problem(len(name), mask=mask, is_weights=name.startswith("token"), adv_per_token=mask == "random")
    config = LossConfig(loss_type="luspo", beta=0.2, luspo_include_padding=True, **{"guide": "none", **CASES[name]})
    native = {"cpu-native": True, "cpu-torch": False}.get(backend)
    out = parity.check_against_reference(
        problem, config, backend.split("-")[0], torch.float32, native=native, seed=len(name)
    )
    _, grads = parity.run(problem, config, backend.split("-")[0], torch.float32, native=native)
    assert_padded_rows_have_gradient(problem, grads["hidden"])
    assert (out.kl[~problem["mask"].bool()] != 0).any(), "the KL is formed at padded positions"


def test_triton_takes_the_two_pass_path():
    problem = far_problem(1, mask="tail")
    PATHS_TAKEN.clear()
    parity.run(problem, LossConfig(loss_type="luspo", luspo_include_padding=True), "triton")
    assert PATHS_TAKEN == {"two-pass": 1}


# No shrinking: each example costs about a second under the interpreter; the failing one is printed as drawn.
@settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(
    shape=st.tuples(st.integers(1, 4), st.integers(1, 12), st.integers(2, 300), st.integers(1, 40)),
    mask=st.sampled_from(["tail", "random", "all"]),
    level=st.sampled_from(["token", "sequence"]),
    kl=st.sampled_from(["k1", "k3", "fk3"]),
    bias_kl=st.booleans(),
    old=st.booleans(),
    is_weights=st.booleans(),
    backend=st.sampled_from(["triton", "cpu"]),
    seed=st.integers(0, 1000),
)
def test_property_backends_match_the_reference(shape, mask, level, kl, bias_kl, old, is_weights, backend, seed):
    B, L, V, D = shape
    problem = far_problem(seed, B=B, L=L, V=V, D=D, mask=mask, old=old, is_weights=is_weights)
    config = LossConfig(
        loss_type="luspo",
        luspo_include_padding=True,
        beta=0.1,
        kl=kl,
        guide="none",
        importance_sampling=level,
        use_bias_correction_kl=bias_kl,
    )
    parity.check_against_reference(problem, config, backend, torch.float32, seed=seed)


# ---------------------------------------------------------------- what the option reads, and refuses


def test_only_with_luspo():
    with pytest.raises(ValueError, match="luspo_include_padding"):
        LossConfig(loss_type="grpo", luspo_include_padding=True)
    with pytest.raises(ValueError, match="luspo_include_padding"):
        LossConfig(loss_type="luspo", luspo_include_padding=1)


def test_padded_positions_are_read_and_checked():
    problem = far_problem(3, mask="random", ref=True)
    args = (problem["hidden"], problem["weight"], problem["token_ids"].clone(), problem["mask"], problem["advantages"])
    kwargs = dict(ref_logp=problem["ref_logp"].clone(), loss_type="luspo", backend="reference")
    padded = ~problem["mask"].bool()
    args[2][padded] = 10_000  # out of range where nothing is read by default
    fused_linear_sage_loss(*args, **kwargs)
    with pytest.raises(ValueError, match=r"token_ids must be in \[0, V=200\) at every position"):
        fused_linear_sage_loss(*args, luspo_include_padding=True, **kwargs)
    args[2][padded] = 0
    kwargs["ref_logp"][padded] = float("nan")
    fused_linear_sage_loss(*args, **kwargs)
    with pytest.raises(ValueError, match="ref_logp has non-finite values"):
        fused_linear_sage_loss(*args, luspo_include_padding=True, **kwargs)
