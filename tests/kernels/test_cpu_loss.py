"""The CPU backend (`sage_kernels.cpu`) against the float64 reference, on both of its paths:
``native`` (the csrc operator) and ``torch`` (the chunked PyTorch fallback).

Every output is checked: the loss, the per-token logp, entropy, q, kl, ratio, the metrics,
and the gradients of hidden, weight and bias under a random upstream gradient. Shapes are
hostile on purpose: V = 1000 and 1271, D = 96, padded rows, all-masked rows, confident and
flat logits, and the blocks never divide the valid rows evenly (the block size is capped by
N*V/16, so these small problems run many blocks).
"""

from __future__ import annotations

import parity
import pytest
import torch
from alloc import AllocationRecorder
from cpu_cases import make_case
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import assert_close

from sage_kernels import LossConfig, cpu, logprobs_and_entropy
from sage_kernels.inputs import validate_inputs
from sage_kernels.reference import reference_logprobs_and_entropy

PATHS = ("native", "torch")

#: option sets covering every field of LossConfig at least once.
OPTION_CASES = {
    "defaults": {},
    "k1-bnpo": dict(kl="k1", loss_type="bnpo"),
    "fk3-dapo": dict(kl="fk3", loss_type="dapo"),
    "k2-dr_grpo": dict(kl="k2", loss_type="dr_grpo", max_completion_length=50),
    "dapo-items": dict(loss_type="dapo", num_items_in_batch=97),
    "dapo-items-tensor": dict(loss_type="dapo", num_items_in_batch=torch.tensor(61.0)),
    "guide-none-beta0": dict(guide="none", beta=0.0),
    "clips": dict(delta_clip=1.5, dual_clip_c=3.0, eps_low=0.1, eps_high=0.28),
    "sequence-ratio": dict(importance_sampling="sequence"),
    "entropy-quantile": dict(top_entropy_quantile=0.4, entropy_coef=0.02),
    "temperature-entropy-bonus": dict(temperature=0.6, entropy_coef=0.5, beta=0.2),
    "branch-tight": dict(gamma=1.0, tau=0.5, q_min=0.8, q_max=1.2),
    "cispo-bias-kl": dict(loss_type="cispo", eps_high=1.1, use_bias_correction_kl=True),
    "sapo-temperatures": dict(loss_type="sapo", sapo_temperature_pos=1.5, sapo_temperature_neg=0.7),
    "vespo-parameters": dict(
        loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=2.0, vespo_k_neg=2.0, vespo_lambda_neg=1.0
    ),
    "luspo-sequence": dict(loss_type="luspo", importance_sampling="sequence"),
    "kl-clamp": dict(kl_clamp=0.3, kl="fk3"),
    # the head's output reaches ~8 sqrt(D)/sqrt(D) * |w| ~ 20: a softcap of 4 saturates many logits
    "logit-scale": dict(logit_scale=0.4, temperature=0.7),
    "logit-softcap-scale-entropy": dict(logit_softcap=4.0, logit_scale=1.6, temperature=1.3, entropy_coef=0.05),
    "logit-softcap-sequence": dict(logit_softcap=4.0, importance_sampling="sequence"),
}


def check_against_reference(case, config, path, *, frozen=(), seed=0):
    """Every output and gradient of the CPU backend's `path` against the float64 reference."""
    parity.check_against_reference(case, config, "cpu", native=path == "native", frozen=frozen, seed=seed)


def run(case, config, *, backend, path=None, upstream=1.0):
    return parity.run(case, config, backend, native=None if path is None else path == "native", upstream=upstream)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("options", OPTION_CASES.values(), ids=OPTION_CASES.keys())
def test_every_option_matches_reference(path, options):
    case = make_case(seed=len(str(options)))
    check_against_reference(case, LossConfig(**options), path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_inputs(path, dtype):
    check_against_reference(make_case(dtype=dtype, seed=3), LossConfig(entropy_coef=0.01), path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "variant",
    [
        "on-policy",
        "no-ref-beta0",
        "is-weights-log-q",
        "token-advantages",
        "no-bias-frozen-weight",
        "frozen-hidden-and-bias",
        "v1000-all-rows-valid",
        "entropy-term-only",
        "non-contiguous-hidden",
    ],
)
def test_input_variants(path, variant):
    config = LossConfig()
    frozen = ()
    if variant == "on-policy":
        case = make_case(old_logp=False, seed=11)
    elif variant == "no-ref-beta0":
        case, config = make_case(ref_logp=False, seed=12), LossConfig(beta=0.0)
    elif variant == "is-weights-log-q":
        case = make_case(is_weights=True, log_q=True, seed=13)
    elif variant == "token-advantages":
        case = make_case(token_advantages=True, seed=14)
    elif variant == "no-bias-frozen-weight":
        case, frozen = make_case(bias=False, seed=15), ("weight",)
    elif variant == "frozen-hidden-and-bias":  # only the LM head trains
        case, frozen = make_case(seed=18), ("hidden", "bias")
    elif variant == "non-contiguous-hidden":
        case = make_case(seed=19)
        case["hidden"] = case["hidden"].transpose(0, 1).contiguous().transpose(0, 1)
        assert not case["hidden"].is_contiguous()
    elif variant == "entropy-term-only":  # g = 0: the gradient is the entropy bonus's alone
        case, config = make_case(seed=17), LossConfig(beta=0.0, entropy_coef=0.3)
        case["advantages"].zero_()
    else:
        case = make_case(B=2, L=40, V=1000, masked_rows=(), seed=16)
        case["mask"][:] = True
        case["token_ids"].clamp_(max=999)
        case["old_logp"] = torch.nan_to_num(case["old_logp"], nan=-5.0)
        case["ref_logp"] = torch.nan_to_num(case["ref_logp"], nan=-5.0)
    check_against_reference(case, config, path, frozen=frozen)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("logits", ["confident", "flat"])
def test_extreme_logits(path, logits):
    scale = (40.0, 60.0) if logits == "confident" else (1e-4, 1e-3)
    check_against_reference(make_case(logit_scale=scale, seed=21), LossConfig(entropy_coef=0.03), path)


@pytest.mark.parametrize("path", PATHS)
def test_everything_masked_gives_zero_loss_and_gradients(path):
    case = make_case(B=2, L=5, masked_rows=(0, 1))
    out, grads = run(case, LossConfig(entropy_coef=0.1), backend="cpu", path=path, upstream=2.0)
    assert out.loss.item() == 0.0
    for name, grad in grads.items():
        assert bool((grad == 0).all()), f"grad {name} must be zero"
    assert bool((out.q == 1).all()) and bool((out.ratio == 1).all())
    assert all(torch.isnan(v) for v in out.metrics.values())  # no token: no metric value


def test_second_backward_through_one_loss_is_refused():
    case = make_case(seed=61)
    hidden = case["hidden"].clone().requires_grad_(True)
    config = LossConfig()
    inputs = validate_inputs(
        hidden,
        case["weight"],
        case["token_ids"],
        case["mask"],
        case["advantages"],
        bias=case["bias"],
        old_logp=case["old_logp"],
        ref_logp=case["ref_logp"],
        config=config,
    )
    loss = cpu.sage_loss(inputs, config).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward called twice"):
        loss.backward()


@settings(max_examples=12)
@given(
    B=st.integers(1, 4),
    L=st.integers(1, 23),
    D=st.sampled_from([8, 33, 96]),
    V=st.sampled_from([17, 1000, 1271]),
    path=st.sampled_from(PATHS),
    options=st.sampled_from(list(OPTION_CASES.values())),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes_and_options(B, L, D, V, path, options, seed):
    case = make_case(B, L, D, V, seed=seed, masked_rows=(0,) if B > 1 else ())
    check_against_reference(case, LossConfig(**options), path, seed=seed)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [None, 4.0], ids=["scale-only", "softcap"])
def test_scaled_and_softcapped_logits(path, dtype, softcap):
    # head outputs up to ~20 (make_case), scaled by 1.6: a softcap of 4 saturates many of them
    config = LossConfig(logit_scale=1.6, logit_softcap=softcap, temperature=0.8, entropy_coef=0.05)
    check_against_reference(make_case(dtype=dtype, seed=43), config, path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("logits", [{}, dict(logit_scale=0.7, logit_softcap=3.0)], ids=["plain", "scaled-softcapped"])
def test_scoring_matches_reference(path, dtype, logits):
    case = make_case(dtype=dtype, seed=31, masked_rows=())
    B, L, D = case["hidden"].shape
    ids = case["token_ids"].clamp(max=case["weight"].shape[0] - 1)
    inputs = (case["hidden"].reshape(B * L, D), case["weight"], ids.reshape(-1), case["bias"], 0.8)
    logp, entropy = cpu.logprobs_and_entropy(*inputs, **logits, native=path == "native")
    ref_logp, ref_entropy = reference_logprobs_and_entropy(
        inputs[0].double(),
        inputs[1].double(),
        inputs[2],
        bias=inputs[3].double(),
        temperature=0.8,
        dtype=torch.float64,
        **logits,
    )
    assert logp.dtype == entropy.dtype == torch.float32
    assert_close(logp, ref_logp, dtype, "token", "logp")
    assert_close(entropy, ref_entropy, dtype, "token", "entropy")


@pytest.mark.parametrize("logits", [{}, dict(logit_softcap=30.0)], ids=["plain", "softcapped"])
def test_large_vocabulary_sums_as_well_as_torch(logits):
    """At a real model's vocabulary (SmolLM2's 49152) the native sum-exp is no less accurate than
    PyTorch's float32 log_softmax on the same logits. One float running sum per vector lane over the
    whole row drops the terms below half an ulp of it: that left logp ~4e-5 high on average here,
    ten times torch's error, yet inside the float32 token tolerance (1e-4) the other tests use."""
    gen = torch.Generator().manual_seed(0)
    N, D, V = 64, 64, 49152
    hidden = torch.randn(N, D, generator=gen)
    weight = torch.randn(V, D, generator=gen) * (3.0 / D**0.5)
    ids = torch.randint(0, V, (N,), generator=gen)
    logp, entropy = cpu.logprobs_and_entropy(hidden, weight, ids, None, 1.0, **logits, native=True)
    errors = {}
    for name, dtype in (("oracle", torch.float64), ("torch", torch.float32)):
        errors[name] = reference_logprobs_and_entropy(
            hidden.to(dtype), weight.to(dtype), ids, temperature=1.0, dtype=dtype, **logits
        )
    ref_logp, ref_entropy = errors.pop("oracle")
    torch_logp, torch_entropy = errors["torch"]
    for what, ours, theirs, ref in (
        ("logp", logp, torch_logp, ref_logp),
        ("entropy", entropy, torch_entropy, ref_entropy),
    ):
        ours_err = (ours.double() - ref).abs().max().item()
        torch_err = (theirs.double() - ref).abs().max().item()
        assert ours_err <= torch_err, f"{what}: native error {ours_err:.3g} above torch float32's {torch_err:.3g}"
        bias = (ours.double() - ref).mean().abs().item()
        assert bias <= 1e-6, f"{what}: native errors average {bias:.3g}, a systematic rounding"


def test_auto_backend_is_cpu_for_cpu_tensors():
    case = make_case(seed=41)
    config = LossConfig()
    auto, auto_grads = run(case, config, backend="auto")
    native, native_grads = run(case, config, backend="cpu", path="native")
    assert torch.equal(auto.loss, native.loss) and torch.equal(auto_grads["weight"], native_grads["weight"])
    ids = case["token_ids"].clamp(max=case["weight"].shape[0] - 1)
    logp, _ = logprobs_and_entropy(case["hidden"], case["weight"], ids, bias=case["bias"])
    assert logp.shape == ids.shape


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "options", [{}, dict(importance_sampling="sequence", entropy_coef=0.01)], ids=["one-sweep", "two-sweeps"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_no_tensor_of_n_times_v_over_16(path, options, dtype):
    """Forward and backward allocate nothing of N*V/16 elements or more (D < N/16 and D < V/16 here,
    so the gradients of hidden and weight themselves stay below the limit)."""
    case = make_case(B=8, L=128, D=32, V=2048, dtype=dtype, seed=51, masked_rows=(2,))
    N, V = 8 * 128, 2048
    leaves = [case[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    config = LossConfig(**options)
    inputs = validate_inputs(
        *leaves[:2],
        case["token_ids"],
        case["mask"],
        case["advantages"],
        bias=leaves[2],
        old_logp=case["old_logp"],
        ref_logp=case["ref_logp"],
        config=config,
    )
    with AllocationRecorder(limit=N * V // 16) as recorder:
        out = cpu.sage_loss(inputs, config, native=path == "native")
        out.loss.backward()
    recorder.check()
    assert recorder.largest > 0 and all(leaf.grad is not None for leaf in leaves)
