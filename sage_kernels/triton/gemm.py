"""cuBLAS products with a float32 result from 16-bit operands, and the device guard of every launch.

PyTorch's 16-bit matmul rounds its result to the input dtype. Where the installed torch
offers ``out_dtype`` (CUDA builds since 2.8: ``torch.mm(a, b, out_dtype=torch.float32)``),
cuBLAS writes its fp32 accumulator directly, so logits and the hidden-state gradient are
never rounded to bf16 on the way out, and ``addmm(acc, a, b, out_dtype=float32, out=acc)``
accumulates into an fp32 buffer inside the GEMM (beta = 1) with no bf16 temporary. Where it
does not (CPU builds, older torch), the CPU fallback upcasts the operands (exact: bf16 and
fp16 are subsets of fp32) and the CUDA fallback rounds once, as before; `has_fp32_output`
lets callers pick another path instead.

`sliced_mm_f32` splits a product's long inner dimension explicitly: d(hidden) = dz W has a
[T, D] output (about 140 tiles of 128 x 128 at T 640, D 3584) and a V-long inner dimension,
too few output tiles to fill an H100's 132 SMs twice, so the last wave runs half empty unless
cuBLAS happens to split K itself. `vocab_slices` picks the split from the SM count and the shape
alone, so a device and a shape always give the same bits.
"""

from __future__ import annotations

import contextlib
import functools

import torch

#: vocabulary slices of a split product: fewer leave the last wave of output tiles half empty,
#: more cost more fp32 partials to sum than the fuller waves win back.
MIN_SLICES, MAX_SLICES = 4, 8
#: a slice's inner length at least (a shorter K is all prologue and epilogue).
MIN_SLICE_INNER = 2048
#: the fp32 partials of one split product at most, in bytes (T x D x 4 each).
PARTIAL_BYTES = 64 * 2**20
#: the output tile a Hopper cuBLAS kernel of this size takes (128 x 128), for counting waves.
GEMM_TILE = 128
#: output tiles per SM from which the waves are full enough unsplit.
FULL_WAVES = 4


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


@functools.cache
def _probe_batched(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``bmm`` with ``out_dtype=float32`` runs on `device` for `dtype` operands (`_probe`'s
    check for the batched product)."""
    try:
        # the call as `sliced_mm_f32` makes it: into an fp32 `out`, the first operand's rows strided
        a = torch.ones((2, 8), dtype=dtype, device=device).as_strided((2, 2, 4), (4, 8, 1))
        out = torch.zeros((2, 2, 2), dtype=torch.float32, device=device)
        torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32, out=out)
        return out.dtype == torch.float32 and bool((out == 4.0).all())
    except (TypeError, RuntimeError, NotImplementedError, AssertionError):
        return False


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


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


def slice_count(rows: int, cols: int, inner: int, sm_count: int) -> int:
    """Slices of the inner dimension for an fp32 [rows, cols] product on `sm_count` SMs: 1 when its
    128 x 128 output tiles fill `FULL_WAVES` waves or more, or when no split fills the last wave
    better; else the count in MIN_SLICES..MAX_SLICES (each slice at least MIN_SLICE_INNER long, the
    partials within PARTIAL_BYTES) whose tiles leave the fewest SM slots idle, the fewest slices on a tie."""
    tiles = -(-rows // GEMM_TILE) * -(-cols // GEMM_TILE)
    if rows == 0 or tiles >= FULL_WAVES * sm_count:
        return 1

    def filled(slices: int) -> float:  # the share of the SM slots of its waves that do work
        work = tiles * slices
        return work / (-(-work // sm_count) * sm_count)

    most = min(MAX_SLICES, inner // MIN_SLICE_INNER, PARTIAL_BYTES // (4 * rows * cols))
    best = max(range(MIN_SLICES, most + 1), key=lambda s: (filled(s), -s), default=1)
    return best if best > 1 and filled(best) > filled(1) else 1


def vocab_slices(device: torch.device, dtype: torch.dtype, rows: int, cols: int, inner: int) -> int:
    """`slice_count` for an fp32 [rows, cols] product of `dtype` operands with an `inner`-long K on
    `device`: 1 off CUDA and where the batched product cannot write fp32 (`sliced_mm_f32` then takes
    one product)."""
    if device.type != "cuda" or not (dtype == torch.float32 or _probe_batched(torch.device(device), dtype)):
        return 1
    return slice_count(rows, cols, inner, _sm_count(torch.device(device)))


def sliced_mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, partials: torch.Tensor | None) -> torch.Tensor:
    """out (float32) = a @ b as one batched product over S equal slices of the inner dimension
    (S = partials.shape[0]; None or S = 1: `mm_f32`), each slice's product in its own fp32 partial
    [S, M, N], the columns past S equal slices added into the first partial, then the partials
    summed over S (one reduction, no atomics: the same bits for the same device and shape)."""
    if partials is None or partials.shape[0] == 1:
        return mm_f32(a, b, out)
    slices = partials.shape[0]
    (m, k), n = a.shape, b.shape[1]
    width = k // slices
    a_sliced = a.as_strided((slices, m, width), (width * a.stride(1), a.stride(0), a.stride(1)))
    b_sliced = b.as_strided((slices, width, n), (width * b.stride(0), b.stride(0), b.stride(1)))
    if a.dtype == torch.float32:
        torch.bmm(a_sliced, b_sliced, out=partials)
    elif a.device.type == "cuda":
        torch.bmm(a_sliced, b_sliced, out_dtype=torch.float32, out=partials)
    else:  # CPU: exact upcast, as `mm_f32`
        torch.bmm(a_sliced.float(), b_sliced.float(), out=partials)
    if slices * width < k:
        addmm_f32_(partials[0], a[:, slices * width :], b[slices * width :])
    return torch.sum(partials, 0, out=out)
