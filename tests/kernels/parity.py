"""The backend parity harness: one backend against the float64 reference, on everything it returns.

Each check runs the backend on inputs of the problem's dtype and the reference on the same values
cast to float64, backpropagates loss * (a random scalar) through both and compares the loss, the
per-token outputs, the metrics and the gradients of hidden, weight and bias with the tolerances
of `tolerances.py`. `problem` is a dict with the loss's inputs (hidden, weight, bias, token_ids,
mask, advantages, old_logp, ref_logp, is_weights, log_q, optionally sampling_logp); `frozen` names
leaves that need no gradient; `make_problem` draws one on DEVICE (CUDA when there is one, else the CPU).
"""

from __future__ import annotations

import math

import torch
from tolerances import assert_close, assert_grad_close

from sage_kernels import cpu, fused_linear_sage_loss
from sage_kernels.inputs import validate_inputs
from sage_kernels.metrics import METRIC_NAMES
from sage_kernels.reference import reference_logprobs_and_entropy

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F64 = torch.float64
PER_TOKEN = ("logp", "entropy", "q", "kl", "ratio")
LEAVES = ("hidden", "weight", "bias")
OPTIONAL = ("old_logp", "ref_logp", "is_weights", "log_q", "sampling_logp")


def make_problem(
    B=3,
    L=13,
    V=1271,
    D=96,
    *,
    dtype=torch.float32,
    seed=0,
    bias=True,
    weight_scale=1.0,
    mask="random",
    adv_per_token=False,
    old=True,
    ref=True,
    is_weights=False,
    log_q=False,
):
    """Inputs of one loss call on DEVICE. old/ref log-probs are the true policy log-probs
    plus noise, so ratios straddle the clip range and the KL is of realistic size."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    hidden = randn(B, L, D).to(dtype)
    weight = (randn(V, D) * weight_scale / math.sqrt(D)).to(dtype)
    b = (randn(V) * 0.5).to(dtype) if bias else None
    token_ids = torch.randint(0, V, (B, L), generator=gen)
    if mask == "random":
        m = torch.rand(B, L, generator=gen) < 0.75
        m[-1] = False  # an all-masked row
        m[0, 0] = True
    elif mask == "tail":  # completions of different lengths, padded at the end
        lengths = torch.randint(1, L + 1, (B,), generator=gen)
        m = torch.arange(L)[None, :] < lengths[:, None]
    else:
        m = torch.zeros(B, L, dtype=torch.bool) if mask == "none" else torch.ones(B, L, dtype=torch.bool)
    logp, _ = reference_logprobs_and_entropy(
        hidden.to(F64).reshape(B * L, D),
        weight.to(F64),
        token_ids.reshape(-1),
        bias=None if b is None else b.to(F64),
        dtype=F64,
    )
    logp = logp.view(B, L)
    problem = dict(
        hidden=hidden,
        weight=weight,
        token_ids=token_ids,
        mask=m,
        advantages=randn(B, L) if adv_per_token else randn(B),
        bias=b,
        old_logp=(logp + 0.25 * randn(B, L)).float() if old else None,
        ref_logp=(logp + 0.5 * randn(B, L)).float() if ref else None,
        is_weights=(0.5 + torch.rand(B, L, generator=gen)).float() if is_weights else None,
        log_q=(0.2 * randn(B, L)).float() if log_q else None,
    )
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in problem.items()}


def run(problem, config, backend, dtype=None, *, native=None, frozen=(), upstream=1.0):
    """The loss output and the gradients of hidden, weight and bias after backprop of loss * upstream.

    backend "cpu" with `native` True/False runs that path of the CPU backend (the csrc operator or
    the PyTorch block loop); otherwise `fused_linear_sage_loss` picks the path."""
    dtype = dtype or problem["hidden"].dtype
    leaves = {
        k: None if problem[k] is None else problem[k].detach().to(dtype).clone().requires_grad_(k not in frozen)
        for k in LEAVES
    }
    optional = {k: problem.get(k) for k in OPTIONAL}
    if backend == "cpu" and native is not None:
        inputs = validate_inputs(
            leaves["hidden"],
            leaves["weight"],
            problem["token_ids"],
            problem["mask"],
            problem["advantages"],
            bias=leaves["bias"],
            config=config,
            **optional,
        )
        out = cpu.sage_loss(inputs, config, native=native)
    else:
        out = fused_linear_sage_loss(
            leaves["hidden"],
            leaves["weight"],
            problem["token_ids"],
            problem["mask"],
            problem["advantages"],
            bias=leaves["bias"],
            config=config,
            backend=backend,
            **optional,
        )
    (out.loss * upstream).backward()
    return out, {k: None if v is None else v.grad for k, v in leaves.items()}


def check_against_reference(problem, config, backend, dtype=None, *, native=None, frozen=(), seed=0):
    """Assert `backend` matches the float64 reference on the loss, per-token outputs, metrics and gradients."""
    dtype = dtype or problem["hidden"].dtype
    upstream = float(torch.empty(()).uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(seed)))
    out, grads = run(problem, config, backend, dtype, native=native, frozen=frozen, upstream=upstream)
    ref, ref_grads = run(problem, config, "reference", F64, frozen=frozen, upstream=upstream)
    assert out.loss.dtype == torch.float32 and out.loss.shape == ()
    assert_close(out.loss, ref.loss, dtype, "loss", "loss")
    for name in PER_TOKEN:
        assert_close(getattr(out, name), getattr(ref, name), dtype, "token", name)
    assert sorted(out.metrics) == sorted(METRIC_NAMES)
    for name in METRIC_NAMES:
        if bool(torch.isnan(ref.metrics[name])):  # no unmasked token: no value, in every backend
            assert bool(torch.isnan(out.metrics[name])), f"{name} must be NaN without tokens"
            continue
        assert_close(out.metrics[name], ref.metrics[name], dtype, "token", name)
    for name in LEAVES:
        if ref_grads[name] is None:
            assert grads[name] is None, f"{name} must get no gradient"
            continue
        assert grads[name].dtype == dtype and grads[name].shape == ref_grads[name].shape
        assert_grad_close(grads[name], ref_grads[name], dtype, f"grad {name}")
    if grads["hidden"] is not None and not config.luspo_include_padding:  # that option sums padded rows in
        hidden_grad = grads["hidden"].reshape(problem["mask"].shape + (-1,))
        assert bool((hidden_grad[~problem["mask"].bool()] == 0).all()), "masked rows must get exactly zero gradient"
    return out
