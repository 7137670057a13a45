"""The providers of the loss benchmark: our backends and the peers, behind one interface.

A provider's `loss(inputs)` returns the scalar loss of the shared settings below, and is
differentiable in ``inputs.hidden`` and ``inputs.weight``; the harness calls it under
``torch.no_grad()`` for the `fwd` mode and calls ``.backward()`` for `fwd+bwd`. `unavailable`
names why a provider cannot run (missing package or backend, wrong device), so its rows
are reported as skipped instead of dropped.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sage_kernels import fused_linear_sage_loss

from . import trl_head, verl_head
from .chunked_loss import chunked_grpo_loss
from .shapes import Inputs

#: One set of loss settings for every provider: the peers have no guide, so ours runs with the
#: guide off too, and again with the branch guide as separate `*-branch` providers.
SETTINGS = {"beta": 0.05, "kl": "k3", "eps_low": 0.2, "eps_high": 0.2, "loss_type": "grpo", "temperature": 1.0}
GEMM_CHUNK_TOKENS = 2048


@dataclass(frozen=True)
class Provider:
    name: str
    loss: Callable[[Inputs], torch.Tensor]
    guide: str | None  # the guide of its loss, for the float64 check; None: no loss (gemm-floor)
    unavailable: Callable[[str], str | None]
    ours: bool = False
    #: TF32 for fp32 matmuls on CUDA while it runs (`torch.backends.cuda.matmul.allow_tf32`; off by
    #: default in PyTorch): Liger's backward multiplies in fp32, so its time with TF32 on is shown too.
    tf32: bool = False


def _sage(backend: str, guide: str):
    def loss(x: Inputs) -> torch.Tensor:
        return fused_linear_sage_loss(
            x.hidden,
            x.weight,
            x.token_ids,
            x.mask,
            x.advantages,
            old_logp=x.old_logp,
            ref_logp=x.ref_logp,
            backend=backend,
            guide=guide,
            **SETTINGS,
        ).loss

    return loss


def _backend_missing(backend: str, device: str) -> str | None:
    """Why `backend` of sage_kernels cannot run on `device`, or None."""
    if backend == "triton" and device != "cuda":
        return "needs a CUDA device"
    if backend == "cpu" and device != "cpu":
        return "runs on CPU tensors only (use --device cpu)"
    try:
        module = importlib.import_module(f"sage_kernels.{backend}")
    except Exception as error:  # an import error of any kind means "not usable here"
        return f"sage_kernels.{backend} does not import ({type(error).__name__}: {error})"
    if not hasattr(module, "sage_loss"):
        return f"sage_kernels.{backend} has no sage_loss yet"
    return None


@functools.cache
def _liger_module(compiled: bool):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    return LigerFusedLinearGRPOLoss(
        beta=SETTINGS["beta"],
        compiled=compiled,
        use_ref_model=True,
        epsilon_low=SETTINGS["eps_low"],
        epsilon_high=SETTINGS["eps_high"],
        loss_type=SETTINGS["loss_type"],
        temperature=SETTINGS["temperature"],
    )


def _liger(compiled: bool):
    def loss(x: Inputs) -> torch.Tensor:
        value, _metrics = _liger_module(compiled)(
            x.hidden,
            x.weight,
            x.token_ids,
            x.mask,
            x.advantages,
            ref_per_token_logps=x.ref_logp,
            old_per_token_logps=x.old_logp,
        )
        return value

    return loss


def _liger_missing(device: str) -> str | None:
    try:
        importlib.import_module("liger_kernel.chunked_loss")
    except Exception as error:
        return f"liger-kernel does not import ({type(error).__name__}: {error}); pip install 'sage-rl[bench]'"
    return None


class _GemmFloor(torch.autograd.Function):
    """The three products a fused loss cannot avoid, and nothing else: z = h W^T, then with z
    standing in for d(logits), dh = z W and dW = z^T h. Chunked over tokens like the losses, so
    its memory is comparable; with gradients wanted all three run in the forward pass."""

    @staticmethod
    def forward(ctx, hidden2d, weight, with_grads):
        grad_h = torch.empty_like(hidden2d) if with_grads else None
        grad_w = torch.zeros_like(weight) if with_grads else None
        for start in range(0, hidden2d.shape[0], GEMM_CHUNK_TOKENS):
            h = hidden2d[start : start + GEMM_CHUNK_TOKENS]
            z = h @ weight.t()
            if with_grads:
                torch.mm(z, weight, out=grad_h[start : start + GEMM_CHUNK_TOKENS])
                grad_w.addmm_(z.t(), h)
        ctx.save_for_backward(grad_h, grad_w)
        return hidden2d.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_loss):
        return *ctx.saved_tensors, None


def _gemm_floor(x: Inputs) -> torch.Tensor:
    # ctx.needs_input_grad is set even under no_grad, so the caller decides.
    with_grads = torch.is_grad_enabled() and (x.hidden.requires_grad or x.weight.requires_grad)
    return _GemmFloor.apply(x.hidden.reshape(-1, x.hidden.shape[-1]), x.weight, with_grads)


def _chunked(x: Inputs) -> torch.Tensor:
    settings = {key: SETTINGS[key] for key in ("beta", "eps_low", "eps_high")}
    return chunked_grpo_loss(x.hidden, x.weight, x.token_ids, x.mask, x.advantages, x.old_logp, x.ref_logp, **settings)


def _always(device: str) -> str | None:
    return None


def _liger_tf32_missing(device: str) -> str | None:
    if device != "cuda":
        return "TF32 is a CUDA setting (the liger-eager row is the same run here)"
    return _liger_missing(device)


#: in the order they run in each group: ours and the GEMM floor first, so that a time limit cuts a peer's
#: row rather than ours; then the peers of the targets (Liger), the others last.
PROVIDERS = {
    p.name: p
    for p in (
        Provider("sage-cpu", _sage("cpu", "none"), "none", functools.partial(_backend_missing, "cpu"), ours=True),
        Provider(
            "sage-triton", _sage("triton", "none"), "none", functools.partial(_backend_missing, "triton"), ours=True
        ),
        Provider("gemm-floor", _gemm_floor, None, _always),
        Provider("liger-compiled", _liger(True), "none", _liger_missing),
        Provider("liger-eager", _liger(False), "none", _liger_missing),
        Provider("liger-eager-tf32", _liger(False), "none", _liger_tf32_missing, tf32=True),
        Provider("naive", _sage("reference", "none"), "none", _always),
        Provider("torch-compile-chunked", _chunked, "none", _always),
        Provider(
            "sage-cpu-branch", _sage("cpu", "branch"), "branch", functools.partial(_backend_missing, "cpu"), ours=True
        ),
        Provider(
            "sage-triton-branch",
            _sage("triton", "branch"),
            "branch",
            functools.partial(_backend_missing, "triton"),
            ours=True,
        ),
        Provider("trl-full-logits", trl_head.full_logits(SETTINGS), "none", trl_head.missing),
        Provider("trl-chunked", trl_head.chunked(SETTINGS), "none", trl_head.missing),
        Provider("verl-fused-linear", verl_head.verl_fused_linear(SETTINGS), "none", verl_head.missing),
        Provider("sage-verl-kernel", verl_head.sage_kernel(SETTINGS), "none", _always),
    )
}
