"""The backend parity harness: one backend against the float64 reference, on everything it returns.

Each check runs the backend on inputs of the problem's dtype and the reference on the same values
cast to float64, backpropagates loss * (a random scalar) through both and compares the loss, the
per-token outputs, the metrics and the gradients of hidden, weight and bias with the tolerances
of `tolerances.py`. `problem` is a dict with the loss's inputs (hidden, weight, bias, token_ids,
mask, advantages, old_logp, ref_logp, is_weights, log_q, optionally sampling_logp); `frozen` names
leaves that need no gradient.
"""

from __future__ import annotations

import torch
from tolerances import assert_close, assert_grad_close

from sage_kernels import cpu, fused_linear_sage_loss
from sage_kernels.inputs import validate_inputs
from sage_kernels.metrics import METRIC_NAMES

F64 = torch.float64
PER_TOKEN = ("logp", "entropy", "q", "kl", "ratio")
LEAVES = ("hidden", "weight", "bias")
OPTIONAL = ("old_logp", "ref_logp", "is_weights", "log_q", "sampling_logp")


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
