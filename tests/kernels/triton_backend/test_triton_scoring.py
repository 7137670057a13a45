"""The forward-only Triton sweep (`logprobs_and_entropy`, backend "triton") against float64.

Runs on CUDA when available, else on CPU under TRITON_INTERPRET=1 (set by conftest.py).
Output buffers are poisoned with NaN so an unwritten element fails.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from tolerances import assert_close

from sage_kernels import logprobs_and_entropy
from sage_kernels.reference import reference_logprobs_and_entropy
from sage_kernels.triton import tiles

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F64 = torch.float64


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    monkeypatch.setattr(tiles, "POISON_BUFFERS", True)


def check_scoring(N, V, D, dtype, *, seed=0, bias=True, temperature=1.0, weight_scale=1.0, **logits):
    """`logits`: the scoring's logit_scale and logit_softcap."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=gen, dtype=F64).to(dtype)
    weight = (torch.randn(V, D, generator=gen, dtype=F64) * weight_scale / math.sqrt(D)).to(dtype)
    b = (torch.randn(V, generator=gen, dtype=F64) * 0.5).to(dtype) if bias else None
    ids = torch.randint(0, V, (N,), generator=gen)
    expected = reference_logprobs_and_entropy(
        hidden.to(F64),
        weight.to(F64),
        ids,
        bias=None if b is None else b.to(F64),
        temperature=temperature,
        dtype=F64,
        **logits,
    )
    logp, entropy = logprobs_and_entropy(
        hidden.to(DEVICE),
        weight.to(DEVICE),
        ids.to(DEVICE),
        bias=None if b is None else b.to(DEVICE),
        temperature=temperature,
        backend="triton",
        **logits,
    )
    assert logp.dtype == entropy.dtype == torch.float32
    assert_close(logp.cpu(), expected[0], dtype, "token", "logp")
    assert_close(entropy.cpu(), expected[1], dtype, "token", "entropy")
    return logp, entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("N, V, D", [(39, 1000, 96), (70, 1271, 96), (5, 1271, 33)])
def test_hostile_shapes_and_dtypes(N, V, D, dtype):
    check_scoring(N, V, D, dtype, seed=N + V + D, temperature=0.8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("softcap", [None, 2.0], ids=["scale-only", "softcap"])
def test_scaled_and_softcapped_logits(softcap, dtype):
    check_scoring(
        37, 1000, 48, dtype, seed=5, temperature=0.7, weight_scale=2.0, logit_scale=1.8, logit_softcap=softcap
    )


@pytest.mark.parametrize("weight_scale", [0.0, 60.0], ids=["flat", "confident"])
def test_flat_and_confident_logits(weight_scale):
    logp, entropy = check_scoring(33, 1000, 64, torch.float32, weight_scale=weight_scale, bias=False)
    if weight_scale == 0.0:
        torch.testing.assert_close(entropy, torch.full_like(entropy, math.log(1000)), atol=1e-5, rtol=0)
    else:
        assert (entropy >= 0).all()


def test_vocab_splits(monkeypatch):
    monkeypatch.setitem(tiles.TILE_OVERRIDE, "splits", 4)
    check_scoring(45, 1271, 72, torch.float32, seed=4)
    check_scoring(45, 1271, 72, torch.bfloat16, seed=4)


def test_batched_shape_is_kept():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 7, 32, generator=gen).to(DEVICE)
    weight = torch.randn(300, 32, generator=gen).to(DEVICE)
    ids = torch.randint(0, 300, (2, 7), generator=gen).to(DEVICE)
    logp, entropy = logprobs_and_entropy(hidden, weight, ids, backend="triton")
    flat = logprobs_and_entropy(hidden.reshape(14, 32), weight, ids.reshape(14), backend="triton")
    assert logp.shape == entropy.shape == (2, 7)
    torch.testing.assert_close(logp.reshape(14), flat[0], atol=0, rtol=0)
    torch.testing.assert_close(entropy.reshape(14), flat[1], atol=0, rtol=0)


@settings(max_examples=8, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(
    N=st.integers(1, 64),
    V=st.integers(2, 1300),
    D=st.integers(1, 96),
    bias=st.booleans(),
    temperature=st.floats(0.3, 2.0),
    seed=st.integers(0, 100),
)
def test_random_shapes(N, V, D, bias, temperature, seed):
    check_scoring(N, V, D, torch.float32, seed=seed, bias=bias, temperature=temperature)
