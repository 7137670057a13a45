"""The loss types cispo, sapo, luspo, vespo, gmpo and the bias-corrected KL (TRL 1.16's definitions).

The float64 reference's per-token stage is held against Liger-Kernel's own per-token GRPO maths
(``LigerFusedLinearGRPOFunction.ppo_loss_fn``, run in float64), TRL's own VESPO weight
(``GRPOTrainer.get_gamma_weights``) and, for gmpo (which neither has), a direct row-by-row
implementation of GMPO's definition, with old log-probs far from the current ones so clipping and
gating are exercised; then the CPU and Triton backends are held against the reference.
"""

from __future__ import annotations

import math

import parity
import pytest
import torch
from far_cases import ADVANTAGE_SIGNS, B, L, far_batch, far_problem, liger_loss
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from stage_harness import max_rel_err, stage

from sage_kernels import LossConfig
from sage_kernels.loss_types import per_token_grad_is_local
from sage_kernels.triton import three_matmul

F64 = torch.float64
VARIANTS = {
    "cispo": dict(loss_type="cispo", eps_high=1.2),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=1.5, sapo_temperature_neg=2.0),
    "luspo-sequence": dict(loss_type="luspo", importance_sampling="sequence"),
    "vespo": dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5),
    "grpo-bias_kl": dict(loss_type="grpo", use_bias_correction_kl=True),
    "dapo-sequence-bias_kl": dict(loss_type="dapo", importance_sampling="sequence", use_bias_correction_kl=True),
    "cispo-bias_kl": dict(loss_type="cispo", eps_high=2.0, use_bias_correction_kl=True),
    "sapo-bias_kl": dict(loss_type="sapo", use_bias_correction_kl=True),
    "vespo-bias_kl": dict(loss_type="vespo", use_bias_correction_kl=True),
}


@pytest.mark.parametrize("vllm", [False, True], ids=["plain", "vllm_is"])
@pytest.mark.parametrize("name", list(VARIANTS), ids=list(VARIANTS))
def test_reference_matches_liger_float64(name, vllm):
    pytest.importorskip("liger_kernel")
    options = VARIANTS[name]
    # Liger sums luspo's per-token loss over padded positions too, TRL 1.16 (our default) masks them: compare on
    # full rows here (test_luspo_padding.py compares luspo_include_padding with Liger on padded rows).
    batch = far_batch(seed=len(name), full_mask=options["loss_type"] == "luspo")
    want_loss, want_grad, want_metrics = liger_loss(batch, options, vllm=vllm)
    loss, per_token, logp, _ = stage(
        batch["logp"],
        batch["entropy"],
        batch["mask"],
        batch["advantages"],
        old_logp=batch["old_logp"],
        ref_logp=batch["ref_logp"],
        is_weights=batch["is_weights"] if vllm else None,
        guide="none",
        beta=0.1,
        **options,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert abs(loss.item() - want_loss.item()) <= 1e-12 * max(abs(want_loss.item()), 1.0)
    assert max_rel_err(grad * batch["mask"], want_grad * batch["mask"]) <= 1e-12
    assert per_token["metrics"]["kl"].item() == pytest.approx(want_metrics[0].item(), rel=1e-12)
    assert per_token["metrics"]["clip_ratio/region_mean"].item() == pytest.approx(want_metrics[1].item(), abs=1e-15)
    if options["loss_type"] in ("cispo",):
        assert 0 < per_token["metrics"]["clip_ratio/region_mean"].item() < 1, "the cap must bind on some tokens"


def test_vespo_weight_is_trls():
    trl_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    from sage_kernels.reference import vespo_weight

    batch = far_batch(seed=3)
    config = LossConfig(loss_type="vespo", vespo_k_neg=2.5)
    mask = batch["mask"].bool()
    log_ratio = torch.where(mask, batch["logp"] - batch["old_logp"], 0.0)
    A = batch["advantages"][:, None]
    want = trl_trainer.GRPOTrainer.get_gamma_weights(
        A,
        log_ratio,
        batch["mask"],
        torch.where(mask, batch["is_weights"], 1.0),
        k_pos=2.0,
        lambda_pos=3.0,
        k_neg=2.5,
        lambda_neg=2.0,
    )
    got = vespo_weight(log_ratio, A, mask, batch["is_weights"], config)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    assert got.min() < 0.5 and got.max() > 0, "far ratios move phi well away from 1"


def test_sapo_at_ratio_one_is_half_gate():
    # r = 1: sigmoid(0) = 1/2, so pg = -2 A / tau and d pg / d logp = -A (PPO's slope at r = 1).
    loss, _, logp, _ = stage(
        [[-1.0]],
        [[0.0]],
        [[1]],
        [0.8],
        old_logp=[[-1.0]],
        guide="none",
        beta=0.0,
        loss_type="sapo",
        sapo_temperature_pos=2.0,
    )
    assert loss.item() == pytest.approx(-2 * 0.8 / 2.0, rel=1e-14)
    assert torch.autograd.grad(loss, logp)[0].item() == pytest.approx(-0.8, rel=1e-14)


def test_cispo_caps_and_detaches_the_ratio():
    # r = e > eps_high = 1.5: weight 1.5, detached; pg = -1.5 A logp, slope -1.5 A.
    loss, out, logp, _ = stage(
        [[-1.0]], [[0.0]], [[1]], [2.0], old_logp=[[-2.0]], guide="none", beta=0.0, loss_type="cispo", eps_high=1.5
    )
    assert loss.item() == pytest.approx(-1.5 * 2.0 * -1.0, rel=1e-14)
    assert torch.autograd.grad(loss, logp)[0].item() == pytest.approx(-3.0, rel=1e-14)
    assert out["metrics"]["clip_ratio/high_mean"].item() == 1.0


def test_luspo_sums_tokens_and_averages_sequences():
    # Two rows of 3 and 1 tokens, on-policy, A = 1: pg = -1 per token; loss = -(3 + 1) / 2.
    loss, _, _, _ = stage(
        [[-1.0, -1.0, -1.0], [-2.0, 0.0, 0.0]],
        [[0.0] * 3] * 2,
        [[1, 1, 1], [1, 0, 0]],
        [1.0, 1.0],
        guide="none",
        beta=0.0,
        loss_type="luspo",
    )
    assert loss.item() == pytest.approx(-2.0, rel=1e-14)


def test_bias_corrected_kl_on_policy_has_the_ratio_slope():
    # ratio = 1 with gradient: d(kl * r)/dlogp = dkl/dlogp + kl.
    ref, lp = math.log(0.25), math.log(0.5)
    loss, out, logp, _ = stage(
        [[lp]], [[0.0]], [[1]], [0.0], ref_logp=[[ref]], guide="none", beta=1.0, use_bias_correction_kl=True
    )
    d = ref - lp
    kl = math.exp(d) - d - 1
    assert loss.item() == pytest.approx(kl, rel=1e-14) and out["kl"].item() == pytest.approx(kl, rel=1e-14)
    assert torch.autograd.grad(loss, logp)[0].item() == pytest.approx(-(math.exp(d) - 1) + kl, rel=1e-13)


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type="cispo", delta_clip=2.0),
        dict(loss_type="sapo", dual_clip_c=3.0),
        dict(loss_type="cispo", eps_high=0.0),
        dict(sapo_temperature_pos=0.0),
        dict(use_bias_correction_kl="yes"),
    ],
    ids=str,
)
def test_options_that_do_not_apply_raise(options):
    with pytest.raises(ValueError, match=next(iter(k for k in options if k != "loss_type"), "loss_type")):
        LossConfig(**options)


# ---------------------------------------------------------------- the backends against the reference

BACKEND_CASES = {
    **VARIANTS,
    "sapo-sequence": dict(loss_type="sapo", importance_sampling="sequence"),
    "cispo-sequence-quantile": dict(
        loss_type="cispo", importance_sampling="sequence", eps_high=1.1, top_entropy_quantile=0.5
    ),
    "vespo-sequence-guide": dict(loss_type="vespo", importance_sampling="sequence", guide="branch", tau=0.5, gamma=1.0),
    "luspo-token-entropy": dict(loss_type="luspo", entropy_coef=0.02, delta_clip=1.5),
    "gmpo": dict(loss_type="gmpo", eps_low=0.4, eps_high=0.4),
    "gmpo-asymmetric-bias_kl": dict(loss_type="gmpo", eps_low=0.3, eps_high=0.6, use_bias_correction_kl=True),
    "gmpo-quantile-entropy": dict(loss_type="gmpo", top_entropy_quantile=0.5, entropy_coef=0.02, guide="branch"),
    "gmpo-off_policy": dict(loss_type="gmpo", eps_low=0.4, eps_high=0.4, off_policy_mask_threshold=0.05),
}
PRESENT = {
    "far-old": {},
    "is-weights-log-q-token-adv": dict(is_weights=True, log_q=True, adv_per_token=True),
    "on-policy": dict(old=False),
}


@pytest.mark.parametrize("present", list(PRESENT), ids=list(PRESENT))
@pytest.mark.parametrize("name", list(BACKEND_CASES), ids=list(BACKEND_CASES))
@pytest.mark.parametrize("backend", ["cpu-native", "cpu-torch", "triton"])
def test_backends_match_the_reference(backend, name, present):
    problem = far_problem(len(name), **PRESENT[present])
    config = LossConfig(beta=0.2, **{"guide": "none", **BACKEND_CASES[name]})
    native = {"cpu-native": True, "cpu-torch": False}.get(backend)
    parity.check_against_reference(problem, config, backend.split("-")[0], torch.float32, native=native, seed=len(name))


variant_options = st.fixed_dictionaries(
    {
        "loss_type": st.sampled_from(["cispo", "sapo", "luspo", "vespo"]),
        "use_bias_correction_kl": st.booleans(),
        "beta": st.sampled_from([0.0, 0.1]),
        "kl": st.sampled_from(["k1", "k3", "fk3"]),
        "guide": st.sampled_from(["none", "branch"]),
        "eps_high": st.floats(0.5, 3.0),
        "sapo_temperature_pos": st.floats(0.3, 3.0),
        "sapo_temperature_neg": st.floats(0.3, 3.0),
        "vespo_k_pos": st.floats(0.0, 4.0),
        "vespo_lambda_pos": st.floats(0.0, 4.0),
        "vespo_k_neg": st.floats(0.0, 4.0),
        "vespo_lambda_neg": st.floats(0.0, 4.0),
        "importance_sampling": st.sampled_from(["token", "sequence"]),
        "top_entropy_quantile": st.sampled_from([1.0, 0.6]),
        "entropy_coef": st.sampled_from([0.0, 0.02]),
    }
)


# No shrinking: each example costs about a second under the interpreter; the failing one is printed as drawn.
@settings(max_examples=15, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(
    opts=variant_options,
    backend=st.sampled_from(["triton", "cpu"]),
    is_weights=st.booleans(),
    old=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_property_new_loss_types_match_the_reference(opts, backend, is_weights, old, seed):
    problem = far_problem(seed, is_weights=is_weights, old=old)
    parity.check_against_reference(problem, LossConfig(**opts), backend, torch.float32, seed=seed)


# ---------------------------------------------------------------- gmpo


def gmpo_direct(batch, *, eps_low, eps_high, beta=0.0, is_weights=False):
    """GMPO's loss from its definition, row by row, differentiable in a fresh copy of logp.

    Row b: each unmasked token's log-ratio l = logp - old_logp is kept where the advantage's sign does
    not make it greedy and replaced by the bound (a constant: no gradient) where it does (A > 0:
    l > eps_high; A < 0: l < -eps_low); A = 0 contributes 0. R_b = exp(mean of those), W_b the
    geometric mean of the row's rollout weights, the row's PG term -mean_t(A_t) W_b R_b, plus beta times
    the row's mean k3 KL to ref_logp; the loss is the mean over rows (an empty row adds 0).
    Returns (loss, grad of loss in logp, number of clipped tokens with A < 0, with A > 0).
    """
    logp = batch["logp"].clone().requires_grad_(True)
    A = batch["advantages"]
    A = A[:, None].expand_as(logp) if A.dim() == 1 else A
    rows, low, high = [], 0, 0
    for b in range(logp.shape[0]):
        keep = batch["mask"][b].bool()
        if not keep.any():
            rows.append(logp.sum() * 0.0)
            continue
        lr = (logp[b] - batch["old_logp"][b])[keep]
        a = A[b][keep]
        terms = []
        for t in range(lr.shape[0]):
            if a[t] > 0 and lr[t] > eps_high:
                terms.append(torch.tensor(eps_high, dtype=F64))
                high += 1
            elif a[t] < 0 and lr[t] < -eps_low:
                terms.append(torch.tensor(-eps_low, dtype=F64))
                low += 1
            elif a[t] == 0:
                terms.append(torch.tensor(0.0, dtype=F64))
            else:
                terms.append(lr[t])
        geometric = torch.exp(torch.stack(terms).mean())
        weight = torch.exp(batch["is_weights"][b][keep].log().mean()) if is_weights else 1.0
        row = -(a.mean()) * weight * geometric
        if beta:
            delta = (batch["ref_logp"][b] - logp[b])[keep]
            row = row + beta * (torch.expm1(delta) - delta).mean()
        rows.append(row)
    loss = torch.stack(rows).mean()
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, low, high


GMPO_ADVANTAGES = {
    "signs": lambda g: ADVANTAGE_SIGNS * (0.5 + torch.rand(B, generator=g, dtype=F64)),
    "with-zero": lambda g: torch.tensor([0.8, 0.0, -1.3, 0.0], dtype=F64),
    "per-token": lambda g: torch.randn(B, L, generator=g, dtype=F64) * (torch.rand(B, L, generator=g) > 0.2),
}


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("is_weights", [False, True], ids=["plain", "is_weights"])
@pytest.mark.parametrize("advantages", list(GMPO_ADVANTAGES), ids=list(GMPO_ADVANTAGES))
@pytest.mark.parametrize("eps", [(0.4, 0.4), (0.2, 0.7)], ids=["eps0.4", "eps0.2-0.7"])
def test_gmpo_reference_matches_the_direct_definition(eps, advantages, is_weights, beta):
    g = torch.Generator().manual_seed(0)  # with far_batch(11): both clips bind for every advantage pattern
    batch = far_batch(seed=11)
    batch["mask"][1] = 0.0  # an all-masked row adds 0 and still counts among the B rows
    batch["advantages"] = GMPO_ADVANTAGES[advantages](g)
    eps_low, eps_high = eps
    want_loss, want_grad, low, high = gmpo_direct(
        batch, eps_low=eps_low, eps_high=eps_high, beta=beta, is_weights=is_weights
    )
    loss, per_token, logp, _ = stage(
        batch["logp"],
        batch["entropy"],
        batch["mask"],
        batch["advantages"],
        old_logp=batch["old_logp"],
        ref_logp=batch["ref_logp"],
        is_weights=batch["is_weights"] if is_weights else None,
        guide="none",
        beta=beta,
        loss_type="gmpo",
        eps_low=eps_low,
        eps_high=eps_high,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert abs(loss.item() - want_loss.item()) <= 1e-12 * max(abs(want_loss.item()), 1.0)
    assert max_rel_err(grad, want_grad) <= 1e-12
    assert bool((grad[batch["mask"] == 0] == 0).all()), "masked positions get no gradient"
    n = batch["mask"].sum().item()
    metrics = per_token["metrics"]
    assert metrics["clip_ratio/low_mean"].item() == pytest.approx(low / n, abs=1e-15)
    assert metrics["clip_ratio/high_mean"].item() == pytest.approx(high / n, abs=1e-15)
    assert metrics["clip_ratio/region_mean"].item() == pytest.approx((low + high) / n, abs=1e-15)
    assert low > 0 and high > 0, "both clips bind on some tokens"
    unclipped = (batch["mask"] > 0) & (grad != 0)
    assert unclipped.any(), "some tokens pass the gradient"
    want_ratio = torch.where(batch["mask"] > 0, (logp.detach() - batch["old_logp"]).exp(), 1.0)
    torch.testing.assert_close(per_token["ratio"], want_ratio)


def test_gmpo_by_hand():
    # One row, A = 1, eps 0.4: l = (0.1, 0.9) -> c = (0.1, 0.4), R = e^0.25; loss = -R;
    # dloss/dlogp = (-R / 2, 0): the clipped token passes nothing. A = -1, l = (-0.9, 0.2): c = (-0.4, 0.2),
    # loss = +e^-0.1, slope (0, e^-0.1 / 2). A = 0: loss 0, slope 0.
    for adv, log_ratios, loss_value, slope in (
        (1.0, (0.1, 0.9), -math.exp(0.25), (-math.exp(0.25) / 2, 0.0)),
        (-1.0, (-0.9, 0.2), math.exp(-0.1), (0.0, math.exp(-0.1) / 2)),
        (0.0, (0.1, 0.9), 0.0, (0.0, 0.0)),
    ):
        old = [[-1.0 - log_ratios[0], -2.0 - log_ratios[1]]]
        loss, out, logp, _ = stage(
            [[-1.0, -2.0]],
            [[0.0, 0.0]],
            [[1, 1]],
            [adv],
            old_logp=old,
            guide="none",
            beta=0.0,
            loss_type="gmpo",
            eps_low=0.4,
            eps_high=0.4,
        )
        assert loss.item() == pytest.approx(loss_value, rel=1e-13, abs=1e-15)
        (grad,) = torch.autograd.grad(loss, logp)
        assert grad[0].tolist() == pytest.approx(slope, rel=1e-13, abs=1e-15)
        assert out["metrics"]["clip_ratio/region_mean"].item() == (0.5 if adv != 0 else 0.0)


def test_gmpo_on_policy_is_the_row_mean_of_the_advantage():
    # ratio 1 with gradient: loss = -mean over rows of A_b, dloss/dlogp_t = -A_b / (B n_b), nothing clipped.
    loss, out, logp, _ = stage(
        [[-1.0, -2.0, -0.5], [-1.0, 0.0, 0.0]],
        [[0.0] * 3] * 2,
        [[1, 1, 1], [1, 0, 0]],
        [0.6, -1.2],
        guide="none",
        beta=0.0,
        loss_type="gmpo",
    )
    assert loss.item() == pytest.approx(-(0.6 - 1.2) / 2, rel=1e-14)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = [[-0.6 / 6] * 3, [1.2 / 2, 0.0, 0.0]]
    assert grad.tolist()[0] == pytest.approx(expected[0], rel=1e-13)
    assert grad.tolist()[1] == pytest.approx(expected[1], rel=1e-13)
    assert out["metrics"]["clip_ratio/region_mean"].item() == 0.0


@pytest.mark.parametrize(
    "options",
    [
        dict(importance_sampling="sequence"),
        dict(delta_clip=2.0),
        dict(dual_clip_c=3.0),
        dict(eps_low=-0.1),
    ],
    ids=str,
)
def test_gmpo_options_that_do_not_apply_raise(options):
    with pytest.raises(ValueError, match=next(iter(options))):
        LossConfig(loss_type="gmpo", **options)


def test_gmpo_eps_low_is_a_log_ratio_bound():
    assert LossConfig(loss_type="gmpo", eps_low=1.5).eps_low == 1.5  # ratio floor e^-1.5: meaningful
    with pytest.raises(ValueError, match="eps_low"):
        LossConfig(loss_type="grpo", eps_low=1.5)


def test_gmpo_takes_no_token_local_fast_path():
    config = LossConfig(loss_type="gmpo")
    assert not per_token_grad_is_local(config)
    assert not three_matmul.exact_for(config)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("present", list(PRESENT), ids=list(PRESENT))
def test_gmpo_bf16_matches_the_reference(backend, present):
    problem = far_problem(5, **PRESENT[present])
    config = LossConfig(loss_type="gmpo", eps_low=0.4, eps_high=0.4, beta=0.2, guide="none")
    parity.check_against_reference(problem, config, backend, torch.bfloat16, seed=5)


@settings(max_examples=10, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(
    shape=st.tuples(st.integers(1, 5), st.integers(1, 12)),
    eps=st.tuples(st.floats(0.05, 1.5), st.floats(0.05, 1.5)),
    backend=st.sampled_from(["triton", "cpu"]),
    present=st.fixed_dictionaries(
        {
            "is_weights": st.booleans(),
            "old": st.booleans(),
            "adv_per_token": st.booleans(),
            "mask": st.sampled_from(["random", "tail"]),
        }
    ),
    beta=st.sampled_from([0.0, 0.1]),
    seed=st.integers(0, 1000),
)
def test_property_gmpo_matches_the_reference(shape, eps, backend, present, beta, seed):
    B_, L_ = shape
    problem = far_problem(seed, B=B_, L=L_, V=97, D=24, **present)
    config = LossConfig(loss_type="gmpo", eps_low=eps[0], eps_high=eps[1], beta=beta, guide="none")
    parity.check_against_reference(problem, config, backend, torch.float32, seed=seed)
