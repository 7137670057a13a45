"""cuBLAS products with a float32 result from 16-bit operands, and the device guard of every launch.

PyTorch's 16-bit matmul rounds its result to the input dtype. Where the installed torch
offers ``out_dtype`` (CUDA builds since 2.8: ``torch.mm(a, b, out_dtype=torch.float32)``),
cuBLAS writes its fp32 accumulator directly, so logits and the hidden-state gradient are
never rounded to bf16 on the way out, and ``addmm(acc, a, b, out_dtype=float32, out=acc)``
accumulates into an fp32 buffer inside the GEMM (beta = 1) with no bf16 temporary. Where it
does not (CPU builds, older torch), the CPU fallback upcasts the operands (exact: bf16 and
fp16 are subsets of fp32) and the CUDA fallback rounds once, as before; `has_fp32_output`
lets callers pick another path instead.
"""

from __future__ import annotations

import contextlib
import functools

import torch


def on_device(t: torch.Tensor):
    """A context that makes `t`'s GPU the current one for a launch (Triton launches on the current
    device's current stream); a no-op for CPU tensors (the interpreter)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


@functools.cache
def _probe(device: torch.device, dtype: torch.dtype, accumulate: bool) -> bool:
    """Whether ``mm`` (or, with `accumulate`, ``addmm`` into its own fp32 output) with
    ``out_dtype=float32`` runs on `device` for `dtype` operands and gives the right numbers."""
    try:
        # the calls as the paths make them: a transposed second operand, an `out` tensor
        a = torch.ones((2, 4), dtype=dtype, device=device)
        out = torch.ones((2, 2), dtype=torch.float32, device=device)
        if accumulate:
            torch.addmm(out, a, a.t(), out_dtype=torch.float32, out=out)
            expected = 5.0
        else:
            torch.mm(a, a.t(), out_dtype=torch.float32, out=out)
            expected = 4.0
        # once per device and dtype, off the hot path: the values say whether beta = 1 was honoured
        return out.dtype == torch.float32 and bool((out == expected).all())
    except (TypeError, RuntimeError, NotImplementedError, AssertionError):  # the last: torch without CUDA
        return False


@torch.compiler.assume_constant_result
def has_fp32_output(dtype: torch.dtype, device: torch.device) -> bool:
    """True when products of `dtype` operands can be written as float32 on `device` without rounding.

    A constant to torch.compile: called while a graph is traced (the loss's path choice), it runs
    once, eagerly, and its answer is baked in, so the probe's CUDA work never enters the graph
    or breaks it."""
    if dtype == torch.float32 or device.type != "cuda":
        return True  # fp32 needs nothing; on CPU the fallback upcasts exactly
    return _probe(torch.device(device), dtype, False)


def mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (float32) = a @ b for operands of one dtype, accumulated and written in fp32."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if a.device.type == "cuda" and _probe(a.device, a.dtype, False):
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    if a.device.type == "cuda":
        return out.copy_(torch.mm(a, b))  # old torch: one rounding to the input dtype
    return torch.mm(a.float(), b.float(), out=out)


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc (float32) += a @ b, the sum formed inside the GEMM where torch allows it."""
    if a.dtype == torch.float32:
        return acc.addmm_(a, b)
    if a.device.type == "cuda" and _probe(a.device, a.dtype, True):
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    if a.device.type == "cuda":
        return acc.add_(a @ b)  # old torch: a 16-bit temporary, rounded once per call
    return acc.addmm_(a.float(), b.float())
