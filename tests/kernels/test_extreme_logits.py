"""Logits at the edge of float32, on the CPU paths (the float32 reference, the native operator and the
PyTorch fallback) against the float64 reference: vocabulary entries masked by a bias of
finfo(float32).min (a common masking idiom), also at temperature 0.5, where those logits overflow to
-inf in float32; gaps of ~1e36 between logits; and temperature 1e-37. Where exp underflows the
probability is exactly 0, and 0 times a huge logit stays 0 (it must neither leave ~1e-38 weights
that a huge logit turns into a wrong entropy, nor 0 * inf = NaN).

An -inf in `bias` (or `weight`) is refused by name in `inputs.validate_inputs`, on every backend."""

from __future__ import annotations

import parity
import pytest
import torch
from cpu_cases import make_case

from sage_kernels import LossConfig, fused_linear_sage_loss, logprobs_and_entropy
from sage_kernels.reference import logits_of, reference_logprobs_and_entropy

PATHS = {"reference": ("reference", None), "native": ("cpu", True), "torch": ("cpu", False)}
F32_MIN = torch.finfo(torch.float32).min


def extreme_case(kind: str, seed: int = 3):
    """(problem, temperature): make_case's inputs with the bias or temperature of `kind`; the sampled
    tokens are ones the policy can draw (never a masked entry; at T = 1e-37 the argmax), and old/ref
    log-probs are the float64 policy's own plus noise, so every loss term stays finite."""
    # at T = 1e-37 the logits stay below ~3 so that z = logits / T stays finite in float32 (gaps ~1e36)
    case = make_case(seed=seed, V=700, D=64, logit_scale=(0.05, 8.0) if kind != "tiny-temperature" else (0.01, 0.3))
    gen = torch.Generator().manual_seed(seed)
    V, (B, L) = case["weight"].shape[0], case["mask"].shape
    temperature = 1.0
    if kind == "masked-vocabulary-hot":  # finfo.min / T overflows: those logits are -inf in float32
        temperature = 0.5
    if kind in ("masked-vocabulary", "masked-vocabulary-hot", "huge-gaps"):
        banned = torch.rand(V, generator=gen) < 0.4
        banned[case["token_ids"][case["mask"]]] = False
        penalty = -1e36 * (1 + torch.rand(V, generator=gen)) if kind == "huge-gaps" else F32_MIN
        case["bias"] = torch.where(banned, penalty, case["bias"])
    else:  # tiny temperature: z = logits * 1e37, gaps ~1e36 between the top logits
        temperature = 1e-37
        z = logits_of(case["hidden"].reshape(B * L, -1), case["weight"], case["bias"], 1.0, torch.float64)
        case["token_ids"] = torch.where(case["mask"], z.argmax(-1).view(B, L), case["token_ids"])
    ids = case["token_ids"].clamp(max=V - 1).reshape(-1)
    with torch.no_grad():
        logp64, _ = reference_logprobs_and_entropy(
            case["hidden"].double().reshape(B * L, -1),
            case["weight"].double(),
            ids,
            bias=case["bias"].double(),
            temperature=temperature,
            dtype=torch.float64,
        )
    logp64 = logp64.view(B, L).float()
    for name, sigma in (("old_logp", 0.3), ("ref_logp", 0.5)):
        case[name] = torch.where(case["mask"], logp64 + sigma * torch.randn(B, L, generator=gen), float("nan"))
    return case, temperature


KINDS = ("masked-vocabulary", "huge-gaps", "tiny-temperature", "masked-vocabulary-hot")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_loss_and_gradients_match_the_float64_reference(path, kind):
    case, temperature = extreme_case(kind)
    backend, native = PATHS[path]
    config = LossConfig(temperature=temperature, entropy_coef=0.05)
    out = parity.check_against_reference(case, config, backend, native=native)
    assert bool(torch.isfinite(out.entropy).all()) and bool(torch.isfinite(out.loss))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_scoring_matches_the_float64_reference(path, kind):
    """`logprobs_and_entropy` on the same inputs: the entropy is the one that the clamp got wrong."""
    case, temperature = extreme_case(kind, seed=4)
    backend, native = PATHS[path]
    B, L = case["mask"].shape
    hidden, ids = case["hidden"].reshape(B * L, -1), case["token_ids"].clamp(max=case["weight"].shape[0] - 1)
    expected_logp, expected_entropy = reference_logprobs_and_entropy(
        hidden.double(),
        case["weight"].double(),
        ids.reshape(-1),
        bias=case["bias"].double(),
        temperature=temperature,
        dtype=torch.float64,
    )
    if backend == "cpu":
        from sage_kernels import cpu

        logp, entropy = cpu.logprobs_and_entropy(
            hidden, case["weight"], ids.reshape(-1), case["bias"], temperature, native=native
        )
    else:
        logp, entropy = logprobs_and_entropy(
            hidden, case["weight"], ids.reshape(-1), bias=case["bias"], temperature=temperature, backend="reference"
        )
    valid = case["mask"].reshape(-1)
    torch.testing.assert_close(entropy[valid].double(), expected_entropy[valid], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(logp[valid].double(), expected_logp[valid], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "cpu", "auto"])
@pytest.mark.parametrize("where", ["bias", "weight"])
@pytest.mark.parametrize("value", [float("-inf"), float("inf"), float("nan")])
def test_a_non_finite_lm_head_is_refused_by_name(backend, where, value):
    case = make_case(seed=5, V=300, D=32)
    case[where] = case[where].clone()
    case[where].view(-1)[17] = value
    with pytest.raises(ValueError, match=f"{where} has non-finite values"):
        fused_linear_sage_loss(
            case["hidden"],
            case["weight"],
            case["token_ids"],
            case["mask"],
            case["advantages"],
            bias=case["bias"],
            old_logp=case["old_logp"],
            ref_logp=case["ref_logp"],
            backend=backend,
        )
    with pytest.raises(ValueError, match=f"{where} has non-finite values"):
        logprobs_and_entropy(
            case["hidden"], case["weight"], case["token_ids"].clamp(max=299), bias=case["bias"], backend=backend
        )


ALL_PATHS = {**PATHS, "triton": ("triton", None)}


def _scored(path: str, hidden, weight, ids, **logits):
    """(logp, entropy) of `path`: the cpu paths through `cpu.logprobs_and_entropy` (native chosen)."""
    backend, native = ALL_PATHS[path]
    if backend == "cpu":
        from sage_kernels import cpu

        map_ = {"temperature": 1.0, "logit_scale": 1.0, "logit_softcap": None, **logits}
        return cpu.logprobs_and_entropy(hidden, weight, ids, None, *map_.values(), native=native)
    return logprobs_and_entropy(hidden, weight, ids, backend=backend, **logits)


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_a_one_token_vocabulary_has_logp_and_entropy_exactly_zero(path, softcap):
    """p = 1: logp = 0 and H = 0 exactly (the native op's softcap path gave a few ulp of z, H < 0)."""
    g = torch.Generator().manual_seed(9)
    hidden, weight = torch.randn(96, 16, generator=g) * 3, torch.randn(1, 16, generator=g)
    ids = torch.zeros(96, dtype=torch.long)
    for temperature in (1.0, 0.7):
        logp, entropy = _scored(path, hidden, weight, ids, temperature=temperature, logit_softcap=softcap)
        assert logp.abs().max().item() == 0.0 and entropy.abs().max().item() == 0.0, (temperature, logp, entropy)
    backend, native = ALL_PATHS[path]
    if backend == "cpu":
        return  # the loss's logp and entropy below come from the sweep above
    out = fused_linear_sage_loss(
        hidden.view(8, 12, 16),
        weight,
        ids.view(8, 12),
        torch.ones(8, 12),
        torch.randn(8, generator=g),
        ref_logp=torch.zeros(8, 12),
        logit_softcap=softcap,
        backend=backend,
    )
    assert out.logp.abs().max().item() == 0.0 and out.entropy.abs().max().item() == 0.0


@pytest.mark.parametrize("path", ALL_PATHS)
def test_a_saturated_softcap_at_a_huge_logit_scale_has_the_reference_gradient(path, monkeypatch):
    """logit_scale 1e38 under a softcap: tanh saturates, the logits stay within ±c and the loss is finite;
    the gradient is 0 where sech^2 is (the native op multiplied g by s / T = 1e38 first: inf, then 0 * inf)."""
    backend, native = ALL_PATHS[path]
    monkeypatch.setenv("SAGE_CPU_NATIVE", "1" if native else "0")
    case = make_case(seed=6, V=50, D=16)
    config = LossConfig(logit_scale=1e38, logit_softcap=30.0, beta=0.04, entropy_coef=0.01)
    out = parity.check_against_reference(case, config, backend, native=native)
    assert bool(torch.isfinite(out.loss))
