"""The PyTorch reference against hand-computed values, gradcheck, and an independent
float64 implementation written the way TRL 0.23's GRPOTrainer (the official SAGE code) computes it."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from stage_harness import max_rel_err, stage

from sage_kernels import LossConfig, fused_linear_sage_loss, logprobs_and_entropy

F64 = torch.float64


# ---------------------------------------------------------------- hand-computed values


@pytest.mark.parametrize(
    "kl, expected",
    [
        ("k1", math.log(2)),
        ("k2", math.log(2) ** 2 / 2),
        ("k3", 0.5 + math.log(2) - 1),
        ("fk3", 0.5 * -math.log(2) - (0.5 - 1)),
    ],
)
def test_kl_estimators_against_hand_values(kl, expected):
    # pi = 0.5, pi_ref = 0.25, guide off: delta = log(0.25 / 0.5) = -log 2
    loss, out, _, _ = stage(
        [[math.log(0.5)]], [[0.0]], [[1]], [0.0], ref_logp=[[math.log(0.25)]], kl=kl, guide="none", beta=1.0
    )
    assert out["kl"].item() == pytest.approx(expected, rel=1e-12)
    assert loss.item() == pytest.approx(expected, rel=1e-12)  # A = 0: the loss is beta * kl


@pytest.mark.parametrize("entropy, q", [(0.5, 1.0), (1.2, 1.0), (2.2, 1.3), (10.0, 1.4)])
def test_branch_guide_shapes_the_anchor(entropy, q):
    loss, out, _, _ = stage([[math.log(0.5)]], [[entropy]], [[1]], [0.0], ref_logp=[[math.log(0.25)]], beta=1.0)
    delta = math.log(0.25 * q / 0.5)
    assert out["q"].item() == pytest.approx(q, rel=1e-12)
    assert out["kl"].item() == pytest.approx(math.exp(delta) - delta - 1, rel=1e-12)
    assert out["metrics"]["sage/q_max"].item() == pytest.approx(q, rel=1e-12)


def test_branch_guide_q_min_binds_when_q_min_above_one():
    _, out, _, _ = stage([[0.0]], [[0.0]], [[1]], [0.0], ref_logp=[[0.0]], beta=1.0, q_min=1.1, q_max=2.0)
    assert out["q"].item() == pytest.approx(1.1)


def test_external_log_q_overrides_the_guide():
    _, out, _, _ = stage(
        [[math.log(0.5)]], [[5.0]], [[1]], [0.0], ref_logp=[[math.log(0.25)]], log_q=[[math.log(2.0)]], beta=1.0
    )
    assert out["q"].item() == pytest.approx(2.0)
    assert out["kl"].item() == pytest.approx(0.0, abs=1e-15)  # anchor 2 * 0.25 = pi


A_ROWS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
MASK = [[1, 1, 0], [1, 0, 0]]


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"loss_type": "grpo"}, -(1.5 + 4.0) / 2),
        ({"loss_type": "bnpo"}, -7.0 / 3),
        ({"loss_type": "dr_grpo"}, -7.0 / (2 * 3)),
        ({"loss_type": "dr_grpo", "max_completion_length": 7}, -7.0 / 14),
        ({"loss_type": "dapo"}, -7.0 / 3),
        ({"loss_type": "dapo", "num_items_in_batch": 10}, -0.7),
        ({"loss_type": "dapo", "num_items_in_batch": torch.tensor(10.0)}, -0.7),
    ],
)
def test_loss_types_normalise_as_trl(options, expected):
    # on-policy, beta 0: the per-token loss is -A
    loss, _, logp, _ = stage(torch.zeros(2, 3), torch.zeros(2, 3), MASK, A_ROWS, beta=0.0, **options)
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_on_policy_gradient_is_minus_advantage_over_count():
    loss, _, logp, _ = stage(torch.zeros(2, 3), torch.zeros(2, 3), MASK, A_ROWS, beta=0.0, loss_type="grpo")
    loss.backward()
    # d/dlogp of mean_b( sum_t m (-A) / n_b ) = -A m / (n_b B), with n = (2, 1) and B = 2
    expected = torch.tensor([[-1.0 / 4, -2.0 / 4, 0.0], [-4.0 / 2, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    "ratio, A, pg, grad_flows, low, high",
    [
        (1.5, +1.0, -1.2, False, 0, 1),  # clipped high
        (1.5, -1.0, +1.5, True, 0, 0),  # unclipped (pessimistic branch)
        (0.5, -1.0, +0.8, False, 1, 0),  # clipped low
        (0.5, +1.0, -0.5, True, 0, 0),
    ],
)
def test_ppo_clipping_both_sides(ratio, A, pg, grad_flows, low, high):
    loss, out, logp, _ = stage([[math.log(ratio)]], [[0.0]], [[1]], [A], old_logp=[[0.0]], beta=0.0, guide="none")
    loss.backward()
    assert loss.item() == pytest.approx(pg, rel=1e-12)
    assert (logp.grad.abs().item() > 0) == grad_flows
    assert out["metrics"]["clip_ratio/low_mean"].item() == low
    assert out["metrics"]["clip_ratio/high_mean"].item() == high
    assert out["metrics"]["clip_ratio/region_mean"].item() == max(low, high)
    assert out["ratio"].item() == pytest.approx(ratio, rel=1e-12)


def test_delta_clip_caps_the_unclipped_ratio():
    loss, _, _, _ = stage([[math.log(1.5)]], [[0.0]], [[1]], [-1.0], old_logp=[[0.0]], beta=0.0, delta_clip=1.3)
    assert loss.item() == pytest.approx(1.3, rel=1e-12)


def test_dual_clip_caps_negative_advantage_terms():
    loss, _, logp, _ = stage(
        [[math.log(5.0)], [math.log(5.0)]],
        [[0.0], [0.0]],
        [[1], [1]],
        [-1.0, 1.0],
        old_logp=[[0.0], [0.0]],
        beta=0.0,
        dual_clip_c=3.0,
        loss_type="bnpo",
    )
    # row 0: pg = -min(-5, -1.2) = 5, capped at -A*c = 3; row 1 (A > 0): -min(5, 1.2) = -1.2
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2, rel=1e-12)
    loss.backward()
    assert logp.grad.abs().max().item() == 0.0  # both terms are constants of logp


def test_all_masked_row_contributes_nothing_and_no_nan():
    ref = torch.tensor([[-1.0, -2.0], [-math.inf, math.nan]], dtype=F64)
    loss, out, logp, entropy = stage(
        torch.tensor([[-0.5, -0.7], [3.0, 4.0]]),
        torch.ones(2, 2),
        [[1, 1], [0, 0]],
        [1.0, 2.0],
        ref_logp=ref,
        old_logp=torch.full((2, 2), -0.6),
        beta=0.05,
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert logp.grad[1].abs().max().item() == 0.0
    assert entropy.grad is None or entropy.grad[1].abs().max().item() == 0.0
    assert out["kl"][1].abs().max().item() == 0.0 and (out["q"][1] == 1).all() and (out["ratio"][1] == 1).all()
    single, _, _, _ = stage(
        torch.tensor([[-0.5, -0.7]]),
        torch.ones(1, 2),
        [[1, 1]],
        [1.0],
        ref_logp=ref[:1],
        old_logp=torch.full((1, 2), -0.6),
        beta=0.05,
    )
    assert loss.item() == pytest.approx(single.item() / 2, rel=1e-12)  # grpo: the empty row counts in B


def test_everything_masked_gives_zero_loss():
    loss, out, _, _ = stage(
        torch.zeros(2, 2),
        torch.ones(2, 2),
        torch.zeros(2, 2),
        [1.0, 1.0],
        ref_logp=torch.zeros(2, 2),
        top_entropy_quantile=0.5,
    )
    assert loss.item() == 0.0
    # no token, no metric value: NaN throughout (the loggers skip it), not a 0 or a 1 that reads as measured
    assert all(torch.isnan(value) for value in out["metrics"].values())


def test_sequence_level_ratio_is_the_geometric_mean():
    loss, out, logp, _ = stage(
        [[math.log(2.0), 0.0, 5.0]],
        [[0.0, 0.0, 0.0]],
        [[1, 1, 0]],
        [1.0],
        old_logp=[[0.0, 0.0, 0.0]],
        beta=0.0,
        importance_sampling="sequence",
        eps_high=10.0,
    )
    assert out["ratio"][0, :2].tolist() == pytest.approx([math.sqrt(2)] * 2, rel=1e-12)
    assert loss.item() == pytest.approx(-math.sqrt(2), rel=1e-12)
    loss.backward()
    # d(-r)/d logp_t = -r / n_valid for each valid token
    assert logp.grad[0, :2].tolist() == pytest.approx([-math.sqrt(2) / 2] * 2, rel=1e-12)
    assert logp.grad[0, 2].item() == 0.0


def test_top_entropy_quantile_keeps_high_entropy_tokens():
    # quantile(0.5) of [1, 2, 3, 4] (linear) = 2.5: keep tokens with H >= 2.5
    loss, _, logp, _ = stage(
        torch.zeros(1, 5),
        [[1.0, 2.0, 3.0, 4.0, 9.0]],
        [[1, 1, 1, 1, 0]],
        [1.0],
        beta=0.0,
        top_entropy_quantile=0.5,
        loss_type="bnpo",
    )
    assert loss.item() == pytest.approx(-2.0 / 4, rel=1e-12)
    loss.backward()
    assert (logp.grad[0] != 0).tolist() == [False, False, True, True, False]


def test_is_weights_multiply_only_the_pg_term():
    loss, _, _, _ = stage(
        [[math.log(0.5)]],
        [[0.0]],
        [[1]],
        [2.0],
        ref_logp=[[math.log(0.25)]],
        is_weights=[[0.5]],
        beta=1.0,
        guide="none",
        kl="k1",
    )
    assert loss.item() == pytest.approx(-2.0 * 0.5 + math.log(2), rel=1e-12)


def test_entropy_bonus_gradient():
    loss, _, _, entropy = stage(
        torch.zeros(1, 2), [[1.0, 3.0]], [[1, 1]], [0.0], beta=0.0, entropy_coef=0.1, loss_type="bnpo"
    )
    assert loss.item() == pytest.approx(-0.1 * 2.0, rel=1e-12)
    loss.backward()
    assert entropy.grad[0].tolist() == pytest.approx([-0.05, -0.05], rel=1e-12)


def test_guide_is_constant_in_backward():
    # with A = 0 the loss is beta * k3(ref + log q(H) - logp): H enters only through q, which has no gradient
    loss, _, _, entropy = stage([[math.log(0.5)]], [[3.0]], [[1]], [0.0], ref_logp=[[math.log(0.25)]], beta=1.0)
    loss.backward()
    assert entropy.grad is None or entropy.grad.abs().max().item() == 0.0


# ---------------------------------------------------------------- independent TRL-style implementation


def trl_style_sage_loss(
    hidden, weight, bias, token_ids, mask, advantages, old_logp, ref_logp, is_weights, log_q, c: LossConfig
):
    """The SAGE loss written as TRL 0.23's GRPOTrainer._compute_loss with the official SAGE anchor."""
    logits = F.linear(hidden, weight, bias) / c.temperature  # [B, L, V]
    per_token_logps = logits.gather(-1, token_ids[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)
    pd = torch.softmax(logits, -1)
    entropies = torch.logsumexp(logits, -1) - (pd * logits).sum(-1)
    m = mask.to(logits.dtype)
    if c.top_entropy_quantile < 1.0:
        threshold = torch.quantile(entropies.detach()[mask], 1 - c.top_entropy_quantile)
        entropy_mask = (entropies.detach() >= threshold) & mask
    else:
        entropy_mask = None
    if log_q is None:
        log_q = (
            (1 + c.gamma * F.relu(entropies.detach() - c.tau)).clamp(c.q_min, c.q_max).log()
            if c.guide == "branch"
            else torch.zeros_like(per_token_logps)
        )
    per_token_kl = None
    if c.beta != 0.0:
        d = ref_logp + log_q - per_token_logps
        r = torch.exp(d)
        per_token_kl = {"k1": -d, "k2": d**2 / 2, "k3": r - d - 1, "fk3": r * d - r + 1}[c.kl]
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    old = per_token_logps.detach() if old_logp is None else old_logp
    log_ratio = per_token_logps - old
    if c.importance_sampling == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - c.eps_low, 1 + c.eps_high)
    if c.delta_clip is not None:
        coef_1 = torch.clamp(coef_1, max=c.delta_clip)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if c.dual_clip_c is not None:
        per_token_loss = torch.where(adv < 0, torch.min(per_token_loss, -adv * c.dual_clip_c), per_token_loss)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if is_weights is not None:
        per_token_loss = per_token_loss * is_weights
    if per_token_kl is not None:
        per_token_loss = per_token_loss + c.beta * per_token_kl
    per_token_loss = per_token_loss - c.entropy_coef * entropies
    if c.loss_type == "grpo":
        return ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if c.loss_type == "bnpo":
        return (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
    if c.loss_type == "dr_grpo":
        return (per_token_loss * m).sum() / (per_token_loss.size(0) * (c.max_completion_length or m.size(1)))
    return (per_token_loss * m).sum() / (c.num_items_in_batch or m.sum().clamp(min=1.0))


OPTIONS = st.fixed_dictionaries(
    {
        "beta": st.sampled_from([0.0, 0.05, 0.3]),
        "kl": st.sampled_from(["k1", "k2", "k3", "fk3"]),
        "guide": st.sampled_from(["none", "branch"]),
        "gamma": st.sampled_from([0.3, 1.0]),
        "tau": st.sampled_from([0.2, 1.2]),
        "loss_type": st.sampled_from(["grpo", "bnpo", "dr_grpo", "dapo"]),
        "eps_low": st.sampled_from([0.2, 0.1]),
        "eps_high": st.sampled_from([0.2, 0.28]),
        "delta_clip": st.sampled_from([None, 1.5]),
        "dual_clip_c": st.sampled_from([None, 3.0]),
        "importance_sampling": st.sampled_from(["token", "sequence"]),
        "top_entropy_quantile": st.sampled_from([1.0, 0.5]),
        "entropy_coef": st.sampled_from([0.0, 0.01]),
        "temperature": st.sampled_from([1.0, 0.7]),
    }
)


def random_problem(seed, B, L, D, V, *, bias, off_policy, is_w, per_token_adv, ext_q, mask_p=0.3, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, D, generator=g, dtype=dtype)
    weight = torch.randn(V, D, generator=g, dtype=dtype) / math.sqrt(D) * 3
    b = torch.randn(V, generator=g, dtype=dtype) if bias else None
    ids = torch.randint(0, V, (B, L), generator=g)
    mask = torch.rand(B, L, generator=g) > mask_p
    adv = torch.randn(B, L, generator=g, dtype=dtype) if per_token_adv else torch.randn(B, generator=g, dtype=dtype)
    ref = torch.log_softmax(torch.randn(B, L, V, generator=g, dtype=dtype), -1).gather(-1, ids[..., None])[..., 0]
    old = ref + 0.3 * torch.randn(B, L, generator=g, dtype=dtype) if off_policy else None
    w = torch.rand(B, L, generator=g, dtype=dtype) * 2 if is_w else None
    log_q = 0.3 * torch.randn(B, L, generator=g, dtype=dtype) if ext_q else None
    return dict(
        hidden=hidden,
        weight=weight,
        bias=b,
        token_ids=ids,
        mask=mask,
        advantages=adv,
        old_logp=old,
        ref_logp=ref,
        is_weights=w,
        log_q=log_q,
    )


def loss_and_grads(fn, problem):
    h = problem["hidden"].clone().requires_grad_(True)
    w = problem["weight"].clone().requires_grad_(True)
    b = None if problem["bias"] is None else problem["bias"].clone().requires_grad_(True)
    loss = fn(h, w, b)
    grads = torch.autograd.grad(loss, [t for t in (h, w, b) if t is not None])
    return loss.detach(), grads


@settings(max_examples=80)
@given(
    options=OPTIONS,
    seed=st.integers(0, 10_000),
    B=st.integers(1, 4),
    L=st.integers(1, 6),
    D=st.integers(1, 8),
    V=st.integers(2, 17),
    bias=st.booleans(),
    off_policy=st.booleans(),
    is_w=st.booleans(),
    per_token_adv=st.booleans(),
    ext_q=st.booleans(),
)
def test_reference_matches_independent_trl_style_float64(
    options, seed, B, L, D, V, bias, off_policy, is_w, per_token_adv, ext_q
):
    p = random_problem(
        seed, B, L, D, V, bias=bias, off_policy=off_policy, is_w=is_w, per_token_adv=per_token_adv, ext_q=ext_q
    )
    if options["top_entropy_quantile"] < 1 and not p["mask"].any():
        p["mask"][0, 0] = True
    config = LossConfig(**options)
    rest = {k: p[k] for k in ("old_logp", "ref_logp", "is_weights", "log_q")}

    def ours(h, w, b):
        return fused_linear_sage_loss(
            h,
            w,
            p["token_ids"],
            p["mask"],
            p["advantages"],
            bias=b,
            config=config,
            backend="reference",
            **{
                k: v
                for k, v in [
                    ("old_logp", rest["old_logp"]),
                    ("ref_logp", rest["ref_logp"]),
                    ("is_weights", rest["is_weights"]),
                    ("log_q", rest["log_q"]),
                ]
            },
        ).loss

    def theirs(h, w, b):
        return trl_style_sage_loss(
            h,
            w,
            b,
            p["token_ids"],
            p["mask"],
            p["advantages"],
            rest["old_logp"],
            rest["ref_logp"],
            rest["is_weights"],
            rest["log_q"],
            config,
        )

    loss_a, grads_a = loss_and_grads(ours, p)
    loss_b, grads_b = loss_and_grads(theirs, p)
    assert abs(loss_a - loss_b).item() <= 1e-10 * max(abs(loss_b).item(), 1e-3)
    for ga, gb in zip(grads_a, grads_b):
        if gb.abs().max() > 0:
            assert max_rel_err(ga, gb) <= 1e-10
        else:
            assert ga.abs().max().item() <= 1e-12


# The branch guide is a constant in backward by definition (q has no gradient), so finite differences,
# which see q move with H, agree with autograd only where q does not depend on the inputs: these cases
# use guide "none" or an external log_q.
@pytest.mark.parametrize(
    "options",
    [
        {"guide": "none"},
        {"guide": "none", "kl": "k2", "loss_type": "bnpo", "dual_clip_c": 3.0, "entropy_coef": 0.01},
        {"guide": "none", "kl": "k1", "importance_sampling": "sequence", "loss_type": "dapo", "temperature": 0.7},
        {"guide": "none", "loss_type": "dr_grpo", "delta_clip": 1.5, "top_entropy_quantile": 0.5},
        {"log_q": torch.full((2, 3), 0.2, dtype=F64), "entropy_coef": 0.05},
        {"guide": "none", "logit_scale": 1.7, "logit_softcap": 1.5, "temperature": 0.8, "entropy_coef": 0.1},
    ],
)
def test_gradcheck_float64(options):
    p = random_problem(
        3, 2, 3, 4, 5, bias=True, off_policy=True, is_w=True, per_token_adv=False, ext_q=False, mask_p=0.2
    )
    p["mask"][0, 0] = True

    def fn(h, w, b):
        return fused_linear_sage_loss(
            h,
            w,
            p["token_ids"],
            p["mask"],
            p["advantages"],
            bias=b,
            old_logp=p["old_logp"],
            ref_logp=p["ref_logp"],
            is_weights=p["is_weights"],
            backend="reference",
            **options,
        ).loss

    inputs = tuple(t.clone().requires_grad_(True) for t in (p["hidden"], p["weight"], p["bias"]))
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


def test_guide_none_equals_trl_grpo_formula():
    """guide="none": exactly TRL's GRPO loss, written from its definition (beta*k3 to pi_ref, clipped PG)."""
    p = random_problem(7, 3, 5, 6, 11, bias=False, off_policy=True, is_w=False, per_token_adv=False, ext_q=False)
    out = fused_linear_sage_loss(
        p["hidden"],
        p["weight"],
        p["token_ids"],
        p["mask"],
        p["advantages"],
        old_logp=p["old_logp"],
        ref_logp=p["ref_logp"],
        guide="none",
        backend="reference",
    )
    logp = torch.log_softmax(p["hidden"] @ p["weight"].T, -1).gather(-1, p["token_ids"][..., None])[..., 0]
    ratio = torch.exp(logp - p["old_logp"])
    A = p["advantages"][:, None]
    pg = -torch.minimum(ratio * A, ratio.clamp(0.8, 1.2) * A)
    kl = torch.exp(p["ref_logp"] - logp) - (p["ref_logp"] - logp) - 1
    m = p["mask"].double()
    expected = (((pg + 0.05 * kl) * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(out.ratio, torch.where(p["mask"], ratio, 1.0), rtol=1e-12, atol=1e-12)
    assert (out.q == 1).all()


def test_float32_reference_close_to_float64():
    p = random_problem(11, 3, 4, 8, 50, bias=True, off_policy=True, is_w=False, per_token_adv=False, ext_q=False)
    f32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in p.items()}
    a = fused_linear_sage_loss(**p, backend="reference")
    b = fused_linear_sage_loss(**f32, backend="reference")
    assert b.loss.dtype == torch.float32
    assert b.loss.item() == pytest.approx(a.loss.item(), rel=1e-5, abs=1e-6)


def test_logprobs_and_entropy_reference():
    p = random_problem(5, 2, 3, 4, 7, bias=True, off_policy=False, is_w=False, per_token_adv=False, ext_q=False)
    logp, ent = logprobs_and_entropy(
        p["hidden"], p["weight"], p["token_ids"], bias=p["bias"], temperature=0.5, backend="reference"
    )
    logprobs = torch.log_softmax((p["hidden"] @ p["weight"].T + p["bias"]) / 0.5, -1)
    torch.testing.assert_close(logp, logprobs.gather(-1, p["token_ids"][..., None])[..., 0])
    torch.testing.assert_close(ent, -(logprobs.exp() * logprobs).sum(-1))
    assert not logp.requires_grad
    flat_logp, _ = logprobs_and_entropy(
        p["hidden"].reshape(6, 4),
        p["weight"],
        p["token_ids"].reshape(6),
        bias=p["bias"],
        temperature=0.5,
        backend="reference",
    )
    torch.testing.assert_close(flat_logp, logp.reshape(6))


def test_frozen_weight_gets_no_gradient():
    p = random_problem(2, 2, 3, 4, 7, bias=False, off_policy=False, is_w=False, per_token_adv=False, ext_q=False)
    h = p["hidden"].clone().requires_grad_(True)
    out = fused_linear_sage_loss(
        h, p["weight"], p["token_ids"], p["mask"], p["advantages"], ref_logp=p["ref_logp"], backend="reference"
    )
    out.loss.backward()
    assert h.grad is not None and p["weight"].grad is None


def test_masked_positions_get_zero_gradient():
    p = random_problem(4, 3, 4, 5, 9, bias=False, off_policy=True, is_w=False, per_token_adv=False, ext_q=False)
    h = p["hidden"].clone().requires_grad_(True)
    out = fused_linear_sage_loss(
        h,
        p["weight"],
        p["token_ids"],
        p["mask"],
        p["advantages"],
        old_logp=p["old_logp"],
        ref_logp=p["ref_logp"],
        backend="reference",
    )
    out.loss.backward()
    assert h.grad[~p["mask"]].abs().max().item() == 0.0
    assert (out.logp[~p["mask"]] == 0).all() and (out.entropy[~p["mask"]] == 0).all()


# ---------------------------------------------------------------- scaled and softcapped logits, against HF models


def tiny_hf_lm(kind: str):
    """A float64 one-layer Gemma2 (final_logit_softcapping 2: most logits of this head reach it)
    or Cohere (logit_scale 0.3) causal LM; vocab 40, hidden 16."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    if kind == "gemma2":
        config = transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=2.0)
        config._attn_implementation = "eager"
        model = transformers.Gemma2ForCausalLM(config)
    else:
        model = transformers.CohereForCausalLM(transformers.CohereConfig(**common, logit_scale=0.3))
    with torch.no_grad():  # a head large enough that the transform matters
        model.get_output_embeddings().weight.mul_(20.0)
    return model.double().eval()


@pytest.mark.parametrize("kind", ["gemma2", "cohere"])
def test_reference_logits_are_the_hf_models_own(kind):
    # logp and entropy of the reference (given the model's hidden states and head, the transform read
    # from its config) equal log_softmax of the model's own output logits / T, with equal gradients
    from sage_kernels.integrations.hf_logits import logit_options
    from sage_kernels.reference import reference_logprobs_and_entropy

    model = tiny_hf_lm(kind)
    options = logit_options(model.config)
    assert options == (
        {"logit_scale": 1.0, "logit_softcap": 2.0} if kind == "gemma2" else {"logit_scale": 0.3, "logit_softcap": None}
    )
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1))
    hidden = model.model(input_ids=ids).last_hidden_state.detach().requires_grad_(True)
    # the model's forward from these same hidden states (a leaf): its own head, transform and loss path
    model.model.register_forward_hook(lambda module, args, output: output.__class__(last_hidden_state=hidden))
    T = 0.7
    logits = model(input_ids=ids).logits / T
    assert kind != "gemma2" or logits.abs().max() * T > 1.9  # the softcap binds
    targets = torch.roll(ids, -1, 1)
    logprobs = torch.log_softmax(logits, -1)
    hf_logp = logprobs.gather(-1, targets[..., None])[..., 0]
    hf_entropy = -(logprobs.exp() * logprobs).sum(-1)
    weight = model.get_output_embeddings().weight
    logp, entropy = reference_logprobs_and_entropy(
        hidden.reshape(14, 16), weight, targets.reshape(14), temperature=T, dtype=F64, **options
    )
    torch.testing.assert_close(logp, hf_logp.reshape(14), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(entropy, hf_entropy.reshape(14), atol=1e-12, rtol=1e-12)
    upstream = torch.randn(2, 14, generator=torch.Generator().manual_seed(2), dtype=F64)
    ours = torch.autograd.grad((upstream[0] * logp + upstream[1] * entropy).sum(), (hidden, weight))
    theirs = torch.autograd.grad(
        (upstream[0] * hf_logp.reshape(14) + upstream[1] * hf_entropy.reshape(14)).sum(), (hidden, weight)
    )
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    # the scoring entry point takes the same options
    scored, _ = logprobs_and_entropy(
        hidden.detach(), weight.detach(), targets, temperature=T, backend="reference", **options
    )
    torch.testing.assert_close(scored, hf_logp.detach(), atol=1e-12, rtol=1e-12)
