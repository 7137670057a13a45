"""The verl adapters against verl's formulas, written out here, and against verl itself when it imports.

verl 0.9 pins transformers < 5.11 and needs ray, so it does not install beside this project's
transformers; the `real_verl` tests run where it does (they were run in a side environment).
"""

import importlib
import importlib.util
import sys

import pytest
import torch
from alloc import NewStorageRecorder
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import assert_close, assert_grad_close
from verl_cases import AGG_CASES, Config
from verl_peer import rollout_corr_helper, verl_installed

from sage_kernels import fused_linear_sage_loss
from sage_kernels.backends import BACKENDS
from sage_kernels.integrations import verl as sage_verl
from sage_kernels.reference import reference_logprobs_and_entropy

HAS_VERL = verl_installed()  # SAGE_REQUIRE_VERL=1 (the side suite): an error when verl is missing
real_verl = pytest.mark.skipif(not HAS_VERL, reason="verl is not installed here")
BACKEND = "auto"  # integration tests: the default backend of the device ("cpu" here)


def logprobs_entropy_formula(hidden, weight, labels, temperature):
    logits = hidden.float() @ weight.float().t() / temperature
    logprobs = torch.log_softmax(logits, -1)
    return logprobs.gather(-1, labels[..., None]).squeeze(-1), -(logprobs.exp() * logprobs).sum(-1)


def make_head(seed=0, B=3, L=5, D=12, V=29):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, L, D, generator=g),
        torch.randn(V, D, generator=g) * 0.7,
        torch.randint(0, V, (B, L), generator=g),
        g,
    )


def forward_backward(fn, hidden, weight, labels, upstream):
    hidden, weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp, entropy = fn(hidden, weight, labels)
    ((logp * upstream[0]).sum() + (entropy * upstream[1]).sum()).backward()
    return logp.detach(), entropy.detach(), hidden.grad, weight.grad


def test_linear_cross_entropy_matches_formula():
    hidden, weight, labels, g = make_head()
    upstream = (torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g))
    ours = forward_backward(
        lambda h, w, y: sage_verl.linear_cross_entropy(h, w, y, 0.8, backend=BACKEND), hidden, weight, labels, upstream
    )
    want = forward_backward(lambda h, w, y: logprobs_entropy_formula(h, w, y, 0.8), hidden, weight, labels, upstream)
    for name, got, expected in zip(("logp", "entropy", "grad hidden", "grad weight"), ours, want):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_linear_cross_entropy_logp_only_gradient():
    hidden, weight, labels, _ = make_head(seed=1)
    h = hidden.clone().requires_grad_(True)
    sage_verl.linear_cross_entropy(h, weight, labels, backend=BACKEND)[0].sum().backward()
    h2 = hidden.clone().requires_grad_(True)
    logprobs_entropy_formula(h2, weight, labels, 1.0)[0].sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, atol=1e-5, rtol=1e-5)


def test_linear_cross_entropy_backward_twice_through_a_retained_graph():
    """The fused sweep's backward runs once; a second backward (retain_graph) adds the same gradients."""
    hidden, weight, labels, g = make_head(seed=4)
    upstream = (torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g))
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp, entropy = sage_verl.linear_cross_entropy(h, w, labels, 0.8, backend=BACKEND)
    objective = (logp * upstream[0]).sum() + (entropy * upstream[1]).sum()
    objective.backward(retain_graph=True)
    once = h.grad.clone(), w.grad.clone()
    objective.backward()
    for name, twice, first in zip(("hidden", "weight"), (h.grad, w.grad), once):
        torch.testing.assert_close(twice, 2 * first, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=5)
@given(
    lead=st.sampled_from([(1, 9), (3, 5), (2, 24)]),
    D=st.sampled_from([4, 33]),
    V=st.sampled_from([7, 300]),
    temperature=st.sampled_from([1.0, 0.7]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_linear_cross_entropy_matches_the_float64_reference(backend, lead, D, V, temperature, dtype, seed):
    """Each backend's shard sweep behind the adapter: values and both gradients within the dtype's
    tolerance of the float64 reference (verl's [B, T] layout, a loss on logp and entropy)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, D, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, D, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    labels = torch.randint(0, V, lead, generator=g)
    upstream = torch.randn(2, *lead, generator=g, dtype=torch.float64)

    def run(h, w, logprobs_and_entropy):
        h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        logp, entropy = logprobs_and_entropy(h, w)
        ((logp.double() * upstream[0]).sum() + (entropy.double() * upstream[1]).sum()).backward()
        return (logp.detach(), entropy.detach()), (h.grad, w.grad)

    (logp, entropy), grads = run(
        hidden, weight, lambda h, w: sage_verl.linear_cross_entropy(h, w, labels, temperature, backend=backend)
    )
    (want_logp, want_entropy), want_grads = run(
        hidden.double(),
        weight.double(),
        lambda h, w: tuple(
            t.view(lead)
            for t in reference_logprobs_and_entropy(
                h.reshape(-1, D), w, labels.reshape(-1), temperature=temperature, dtype=torch.float64
            )
        ),
    )
    assert logp.shape == entropy.shape == lead and logp.dtype == entropy.dtype == torch.float32
    assert_close(logp, want_logp, dtype, "token", f"{backend} logp")
    assert_close(entropy, want_entropy, dtype, "token", f"{backend} entropy")
    for name, got, want, like in zip(("hidden", "weight"), grads, want_grads, (hidden, weight)):
        assert got.dtype == like.dtype, name
        assert_grad_close(got, want, dtype, f"{backend} grad {name}")


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_linear_cross_entropy_backward_adds_no_zero_target_term(backend):
    # verl's interface returns logp and H, not the shard's lse: the shard sweep's target-row term
    # (d_lse 1[v = y]) has a zero coefficient there, and forming it anyway cost an fp32 copy of
    # each gradient ([V, D]: 4.4 GB of transients at a 7B head) and an [N, D] gather
    g = torch.Generator().manual_seed(4)
    B, L, D, V = 2, 7, 24, 200
    hidden = torch.randn(B, L, D, generator=g, dtype=torch.float64).to(torch.bfloat16)
    weight = (torch.randn(V, D, generator=g, dtype=torch.float64) * 0.7).to(torch.bfloat16)
    labels = torch.randint(0, V, (B, L), generator=g)
    upstream = torch.randn(2, B, L, generator=g, dtype=torch.float64)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = sage_verl.linear_cross_entropy(h, w, labels, 0.8, backend=backend)
    objective = (logp.double() * upstream[0]).sum() + (entropy.double() * upstream[1]).sum()
    with NewStorageRecorder(B * L * D) as recorder:
        objective.backward()
    ops = {op for op, _, _ in recorder.allocated}
    assert not ops & {"aten.index_select.default", "aten.index_add.default"}, recorder.allocated
    weight_sized = [dtype for _, shape, dtype in recorder.allocated if shape == (V, D)]
    # the gradient itself, and where the CPU sweep sums in fp32 its one accumulator: no fp32 copy of either
    assert weight_sized.count(torch.float32) <= (1 if backend == "cpu" else 0), recorder.allocated
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want = reference_logprobs_and_entropy(h64.reshape(-1, D), w64, labels.reshape(-1), temperature=0.8)
    ((want[0].view(B, L) * upstream[0]).sum() + (want[1].view(B, L) * upstream[1]).sum()).backward()
    for name, got, expected in (("hidden", h.grad, h64.grad), ("weight", w.grad, w64.grad)):
        assert got.dtype == torch.bfloat16
        assert_grad_close(got, expected, torch.bfloat16, f"{backend} grad {name}")


@pytest.mark.parametrize(
    "kwargs, argument",
    [(dict(reduction="mean"), "reduction"), (dict(dist_process_group=object()), "dist_process_group")],
    ids=["mean", "not-a-process-group"],
)
def test_linear_cross_entropy_rejects_unsupported(kwargs, argument):
    hidden, weight, labels, _ = make_head()
    with pytest.raises(ValueError, match=f"^{argument} must"):
        sage_verl.linear_cross_entropy(hidden, weight, labels, **kwargs)


def verl_aggregate(
    loss_mat, mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None
):
    """verl's agg_loss, written from its definition."""
    m = mask.float()
    if mode == "token-mean":
        return (loss_mat * m).sum() / (m.sum() if batch_num_tokens is None else batch_num_tokens) * dp_size
    if mode == "token-sum":
        return (loss_mat * m).sum() * dp_size
    seq_mask = (m.sum(-1) > 0).float()
    G = seq_mask.sum() if global_batch_size is None else global_batch_size
    if mode == "seq-mean-token-mean":
        seq = (loss_mat * m).sum(-1) / (m.sum(-1) + 1e-8)
        return (seq * seq_mask).sum() / G * dp_size
    seq = (loss_mat * m).sum(-1)
    loss = (seq * seq_mask).sum() / G * dp_size
    return (
        loss / (loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        if mode == "seq-mean-token-sum-norm"
        else loss
    )


def verl_vanilla(old, logp, A, mask, mode, config, weights=None):
    """verl's vanilla PPO policy loss (clip low/high, dual clip for A < 0), written from its definition."""
    eps_low, eps_high, c = config["clip_ratio_low"], config["clip_ratio_high"], config["clip_ratio_c"]
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-A * ratio, -A * ratio.clamp(1 - eps_low, 1 + eps_high))
    pg = torch.where(A < 0, torch.minimum(pg, -A * c), pg)
    if weights is not None:
        pg = pg * weights
    return verl_aggregate(pg, mask, mode, **config["global_batch_info"])


def policy_batch(seed=0, B=4, L=6):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 3:] = False
    mask[3] = False  # an empty response: excluded from the sequence means
    logp = -torch.rand(B, L, generator=g) * 3
    old = logp + 0.4 * torch.randn(B, L, generator=g)
    A = torch.randn(B, 1, generator=g).expand(B, L) * 2
    return old, logp, A, mask, torch.rand(B, L, generator=g) + 0.5


@pytest.mark.parametrize("case", list(AGG_CASES), ids=list(AGG_CASES))
@pytest.mark.parametrize("with_is", [False, True], ids=["no-is", "rollout-is"])
def test_policy_loss_matches_verl_formula(case, with_is):
    mode, batch_info = AGG_CASES[case]
    config = Config(
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, global_batch_info=batch_info
    )
    old, logp, A, mask, is_w = policy_batch()
    weights = is_w if with_is else None
    results = []
    for fn in (
        lambda lp: sage_verl.compute_policy_loss_sage(old, lp, A, mask, mode, config, weights)[0],
        lambda lp: verl_vanilla(old, lp, A, mask, mode, config, weights),
    ):
        lp = logp.clone().requires_grad_(True)
        loss = fn(lp)
        loss.backward()
        results.append((loss.detach(), lp.grad))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-6, rtol=1e-5)


def verl_sapo(old, logp, A, mask, config, weights=None):
    """verl's sapo policy loss (gate sigmoid(tau (r - 1)) 4 / tau, tau by the sign of A, sequence mean)."""
    ratio = torch.exp((logp - old).clamp(-20.0, 20.0))
    tau = torch.where(A > 0, torch.tensor(config["tau_pos"]), torch.tensor(config["tau_neg"]))
    pg = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * A
    if weights is not None:
        pg = pg * weights
    return verl_aggregate(pg, mask, "seq-mean-token-mean", **config["global_batch_info"])


@pytest.mark.parametrize("batch_info", [{}, dict(global_batch_size=6, dp_size=2)], ids=["local", "global"])
@pytest.mark.parametrize("with_is", [False, True], ids=["no-is", "rollout-is"])
def test_sapo_policy_loss_matches_verl_formula(batch_info, with_is):
    config = Config(tau_pos=1.3, tau_neg=2.0, global_batch_info=batch_info)
    old, logp, A, mask, is_w = policy_batch(seed=2)
    old = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(5))  # far ratios: the gate bends
    weights = is_w if with_is else None
    results = []
    for fn in (
        lambda lp: sage_verl.compute_policy_loss_sage_sapo(old, lp, A, mask, "token-mean", config, weights)[0],
        lambda lp: verl_sapo(old, lp, A, mask, config, weights),
    ):
        lp = logp.clone().requires_grad_(True)
        loss = fn(lp)
        loss.backward()
        results.append((loss.detach(), lp.grad))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-6, rtol=1e-5)


def test_policy_loss_metrics():
    old, logp, A, mask, _ = policy_batch()
    config = Config(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=1.05, global_batch_info={})
    _, metrics = sage_verl.compute_policy_loss_sage(old, logp, A, mask, "token-mean", config)
    m = mask.float()
    ratio = torch.exp(logp - old)
    pg_unclipped, pg_clipped = -A * ratio, -A * ratio.clamp(0.8, 1.2)
    dual = (torch.maximum(pg_unclipped, pg_clipped) > -A * 1.05) & (A < 0)
    expected = {
        "actor/pg_clipfrac": (pg_clipped > pg_unclipped).float(),
        "actor/ppo_kl": old - logp,
        "actor/pg_clipfrac_lower": dual.float(),
    }
    for name, per_token in expected.items():
        assert metrics[name] == pytest.approx(((per_token * m).sum() / m.sum()).item(), abs=1e-7), name
    assert metrics["actor/pg_clipfrac_lower"] > 0  # the case exercises the dual clip


POLICY_LOSSES = {
    "sage": sage_verl.compute_policy_loss_sage,
    "sage_sapo": sage_verl.compute_policy_loss_sage_sapo,
    "sage_dppo_tv": sage_verl.compute_policy_loss_sage_dppo_tv,
    "sage_dppo_kl": sage_verl.compute_policy_loss_sage_dppo_kl,
}
POLICY_CONFIG = Config(clip_ratio=0.2, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05, global_batch_info={})


@pytest.mark.parametrize(
    "argument, shape",
    [
        ("advantages", (4,)),  # [B] with B == L: read per column by a broadcast
        ("advantages", (4, 1)),
        ("old_log_prob", (1, 4)),  # one row broadcast over every row
        ("old_log_prob", (4, 5)),
        ("response_mask", (4,)),
        ("response_mask", (1, 4)),
        ("rollout_is_weights", (4, 1)),
        ("rollout_is_weights", (4,)),
        ("log_prob", (4,)),
    ],
    ids=str,
)
@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
def test_policy_losses_refuse_other_shapes_by_argument_name(loss, argument, shape):
    B = L = 4  # square: the shapes verl's own losses would broadcast without a word
    g = torch.Generator().manual_seed(0)
    args = dict(
        old_log_prob=-torch.rand(B, L, generator=g),
        log_prob=-torch.rand(B, L, generator=g),
        advantages=torch.randn(B, L, generator=g),
        response_mask=torch.ones(B, L, dtype=torch.bool),
        rollout_is_weights=torch.ones(B, L),
    )
    args[argument] = torch.ones(shape, dtype=args[argument].dtype)
    with pytest.raises(ValueError, match=rf"^{argument} must have (log_prob's shape \[B, L\] = \[4, 4\]|2 dim)"):
        POLICY_LOSSES[loss](**args, loss_agg_mode="token-mean", config=POLICY_CONFIG)


@pytest.mark.parametrize("argument", ["old_log_prob", "log_prob", "advantages", "rollout_is_weights"])
def test_policy_loss_refuses_a_nan_where_the_mask_is_set(argument):
    old, logp, A, mask, is_w = policy_batch()
    args = dict(old_log_prob=old, log_prob=logp, advantages=A.clone(), response_mask=mask, rollout_is_weights=is_w)
    args[argument] = args[argument].clone()
    args[argument][3, 0] = float("nan")  # row 3 is masked out: accepted
    sage_verl.compute_policy_loss_sage(**args, config=POLICY_CONFIG)
    args[argument][0, 0] = float("nan")
    with pytest.raises(ValueError, match=f"^{argument} has non-finite values"):
        sage_verl.compute_policy_loss_sage(**args, config=POLICY_CONFIG)


@pytest.mark.parametrize("mode", sage_verl.AGGREGATION_MODES)
@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
def test_nothing_masked_in_gives_loss_zero_and_zero_gradients(loss, mode):
    old, logp, A, mask, is_w = policy_batch()
    logp = logp.clone().requires_grad_(True)
    out, metrics = POLICY_LOSSES[loss](old, logp, A, torch.zeros_like(mask), mode, POLICY_CONFIG, is_w)
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros_like(logp))
    assert metrics == {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/pg_clipfrac_lower": 0.0}


def bypass_config(**correction):
    correction = {
        **dict(loss_type="ppo_clip", rollout_is="token", rollout_is_threshold=2.0, rollout_rs=None),
        **correction,
    }
    return dict(
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        global_batch_info={},
        policy_loss=dict(loss_mode="sage_bypass", rollout_correction=correction),
    )


@pytest.mark.parametrize("threshold", [2.0, "0.8_1.25"], ids=str)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_corr_metrics_equal_verls_functions(level, threshold):
    verl = rollout_corr_helper()
    rollout, logp, _, mask, _ = policy_batch(seed=4)
    ours = sage_verl.compute_rollout_corr_metrics(logp, rollout, mask, level, threshold)
    _, want = verl.compute_rollout_correction_weights(logp - rollout, mask.float(), level, threshold)
    want.update(verl.compute_offpolicy_metrics(logp, rollout, mask.float()))
    assert set(ours) == {"rollout_corr/" + name for name in want}
    for name, value in want.items():
        assert ours["rollout_corr/" + name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_bypass_is_the_sage_loss_against_the_rollout_log_probs_with_its_metrics():
    rollout, logp, A, mask, is_w = policy_batch(seed=5)
    config = bypass_config(rollout_is="sequence", rollout_is_threshold=1.5)
    results = []
    for fn in (
        lambda lp: sage_verl.compute_policy_loss_sage_bypass(rollout, lp, A, mask, "token-mean", config, is_w),
        lambda lp: sage_verl.compute_policy_loss_sage(rollout, lp, A, mask, "token-mean", config),
    ):
        lp = logp.clone().requires_grad_(True)
        loss, metrics = fn(lp)
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)  # rollout_is_weights ignored
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)
    corr = sage_verl.compute_rollout_corr_metrics(logp, rollout, mask, "sequence", 1.5)
    assert results[0][2] == {**results[1][2], **corr}
    assert corr["rollout_corr/rollout_is_ratio_fraction_high"] > 0  # the threshold binds


@pytest.mark.parametrize(
    "config, word",
    [
        (bypass_config(loss_type="reinforce"), "rollout_correction.loss_type must be 'ppo_clip'"),
        (bypass_config(rollout_rs="token_k1"), "rollout_correction.rollout_rs must be off"),
        (bypass_config(rollout_is_batch_normalize=True), "rollout_correction.rollout_is_batch_normalize"),
        (bypass_config(rollout_is_threshold="2_1"), "rollout_is_threshold must be"),
        ({"clip_ratio": 0.2}, "config.policy_loss.rollout_correction is required"),
    ],
    ids=["reinforce", "rollout_rs", "batch_normalize", "threshold", "no-correction"],
)
def test_bypass_refuses_what_it_does_not_compute(config, word):
    rollout, logp, A, mask, _ = policy_batch()
    with pytest.raises(ValueError, match=word):
        sage_verl.compute_policy_loss_sage_bypass(rollout, logp, A, mask, "token-mean", config)


def test_anchor_through_verl_kl_equals_the_fused_sage_kl():
    """verl's low_var_kl (k3) against sage_anchor_log_prob(...) is the fused loss's KL to q * pi_ref."""
    hidden, weight, labels, g = make_head(seed=2)
    mask = torch.ones(labels.shape, dtype=torch.bool)
    mask[0, 3:] = False
    ref = -torch.rand(labels.shape, generator=g) * 4
    guide = dict(gamma=0.8, tau=1.0, q_min=0.6, q_max=1.4)
    out = fused_linear_sage_loss(
        hidden,
        weight,
        labels,
        mask,
        torch.ones(labels.shape[0]),
        ref_logp=ref,
        beta=0.1,
        guide="branch",
        backend=BACKEND,
        **guide,
    )
    anchor = sage_verl.sage_anchor_log_prob(ref, out.entropy, mask, **guide)
    delta = anchor - out.logp
    verl_k3 = torch.where(mask, torch.exp(delta) - delta - 1, 0.0)
    torch.testing.assert_close(verl_k3, out.kl, atol=1e-6, rtol=1e-5)
    assert (out.q[mask] != 1).any()  # the guide moved the anchor


@real_verl
def test_registered_in_verl():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    assert sage_verl.VERL_REGISTERED
    assert get_policy_loss_fn("sage") is sage_verl.compute_policy_loss_sage
    assert get_policy_loss_fn("sage_sapo") is sage_verl.compute_policy_loss_sage_sapo
    assert get_policy_loss_fn("sage_bypass") is sage_verl.compute_policy_loss_sage_bypass


@real_verl
@pytest.mark.parametrize("case", list(AGG_CASES), ids=list(AGG_CASES))
def test_policy_loss_matches_real_verl(case):
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    mode, batch_info = AGG_CASES[case]
    config = OmegaConf.create(
        dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, global_batch_info=batch_info)
    )
    old, logp, A, mask, is_w = policy_batch()
    ours = sage_verl.compute_policy_loss_sage(old, logp, A, mask, mode, config, is_w)
    theirs = get_policy_loss_fn("vanilla")(old, logp, A, mask, mode, config, is_w)
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-6, rtol=1e-5)
    for name, value in theirs[1].items():
        assert ours[1][name] == pytest.approx(value, abs=1e-6), name


@real_verl
def test_linear_cross_entropy_matches_real_verl_and_patches_it():
    import verl.utils.kernel.linear_cross_entropy as verl_kernel
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    hidden, weight, labels, g = make_head(seed=3)
    upstream = (torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g))
    verl_fn = FusedLinearForPPO(chunk_size=4)
    theirs = forward_backward(lambda h, w, y: verl_fn(h, w, y, temperature=0.9), hidden, weight, labels, upstream)
    ours = forward_backward(
        lambda h, w, y: sage_verl.linear_cross_entropy(h, w, y, 0.9, backend=BACKEND), hidden, weight, labels, upstream
    )
    for got, expected in zip(ours, theirs):
        torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-5)
    original = verl_kernel.linear_cross_entropy
    try:
        sage_verl.patch_verl_fused_kernel()
        assert verl_kernel.linear_cross_entropy is sage_verl.linear_cross_entropy
    finally:
        verl_kernel.linear_cross_entropy = original


#: verl 0.9.1's Megatron forwards, which bind ``linear_cross_entropy`` at import (they need megatron.core)
VERL_MODULES_BINDING_AT_IMPORT = (
    "verl.models.mcore.model_forward_fused",
    "verl.models.mcore.model_forward_1f1b_overlap",
)


@real_verl
def test_patch_reaches_the_names_verl_modules_bound_at_import():
    import verl.utils.kernel.linear_cross_entropy as verl_kernel

    original = verl_kernel.linear_cross_entropy
    bound = []
    for name in VERL_MODULES_BINDING_AT_IMPORT:
        try:
            bound.append(importlib.import_module(name))
        except ImportError:  # no megatron.core here: that forward cannot run, nor be patched
            continue
    try:
        patched = sage_verl.patch_verl_fused_kernel()
        assert verl_kernel.linear_cross_entropy is sage_verl.linear_cross_entropy
        assert sorted(patched) == sorted([verl_kernel.__name__, *(module.__name__ for module in bound)])
        for module in bound:
            assert module.linear_cross_entropy is sage_verl.linear_cross_entropy, module.__name__
    finally:
        for name in (verl_kernel.__name__, *(module.__name__ for module in bound)):
            sys.modules[name].linear_cross_entropy = original


@real_verl
@pytest.mark.parametrize("level, threshold", [("token", 2.0), ("sequence", 1.5), ("token", "0.8_1.25")], ids=str)
def test_bypass_matches_real_verl_bypass_mode(level, threshold):
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    config = OmegaConf.create(bypass_config(rollout_is=level, rollout_is_threshold=threshold))
    rollout, logp, A, mask, _ = policy_batch(seed=6)
    results = []
    for fn in (get_policy_loss_fn("sage_bypass"), get_policy_loss_fn("bypass_mode")):
        lp = logp.clone().requires_grad_(True)
        loss, metrics = fn(rollout, lp, A, mask, "token-mean", config, None)
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    (ours, our_grad, our_metrics), (theirs, their_grad, their_metrics) = results
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(our_grad, their_grad, atol=1e-6, rtol=1e-5)
    assert set(our_metrics) == set(their_metrics)
    for name, value in their_metrics.items():
        assert our_metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
