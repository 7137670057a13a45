"""Tile sizes, launch settings and output buffers shared by the Triton kernels.

One table per mode: the GPU settings are a known-good Hopper default (128x128 tiles,
64-wide reduction chunks); under ``TRITON_INTERPRET=1`` the interpreter runs each tile
op through NumPy, so small tiles keep the CPU tests fast and still exercise padded tails.

Specialisation: Triton compiles a variant per value class of each integer argument
(divisible by 16, equal to 1, other). The kernels keep that for D and the row strides,
which decide vectorised, pipelined loads, and opt out (``do_not_specialize``) for
token counts, chunk offsets and, in the sweeps, V, which only enter masks of 2-D tiles: a new
batch shape then reuses the compiled kernel instead of compiling another. The three-matmul
path's row passes let V specialise: their 1-D loads along a row are vectorised only when the
mask ``cols < V`` is known to hold in runs of 16 (V divisible by 16, as real vocabularies are),
at the cost of one more variant for a vocabulary that is not.

`new_buffer` allocates every tensor a kernel writes. Tests set `POISON_BUFFERS` to True
so those buffers start as NaN and an element a kernel forgets to write fails loudly.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

#: set by tests: kernel outputs start as NaN instead of uninitialised memory.
POISON_BUFFERS = False


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(hidden: torch.Tensor) -> None:
    """A clear error unless the kernels can run on `hidden`'s device (CUDA, or the interpreter)."""
    if hidden.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before import "
            f"for CPU tensors); hidden is on {hidden.device}"
        )


@dataclass(frozen=True)
class SweepTiles:
    """Tile shape of a vocabulary sweep: BLOCK_N tokens x BLOCK_V vocab, reduced over D in BLOCK_D chunks."""

    block_n: int
    block_v: int
    block_d: int
    num_warps: int
    num_stages: int
    #: forward vocab splits (0: chosen from the grid size) and backward vocab chunk (0: from V).
    splits: int = 0
    chunk_v: int = 0
    #: three-matmul path: tokens per logits chunk (0: from the workspace budget) and the row
    #: pass's vocab block (one program walks one token's row).
    chunk_n: int = 0
    row_block_v: int = 1024
    #: three-matmul path: vocabulary slices of the d(hidden) product (0: from the SM count and the
    #: shape, `gemm.vocab_slices`; 1: one product).
    dh_slices: int = 0
    #: backward sweep: token blocks that sweep a chunk's vocab tiles together (launch order; see
    #: sweep_bwd.py). 16 blocks of 128 rows at D 3584 bf16 are 15 MB of hidden rows, which a wave
    #: of programs (one per SM) keeps in L2 with the ~8 weight tiles it reads.
    group_n: int = 16


def sweep_tiles(dtype: torch.dtype) -> SweepTiles:
    """The tile shape for inputs of `dtype` on the current platform."""
    if interpreting():
        return SweepTiles(block_n=32, block_v=128, block_d=64, num_warps=1, num_stages=1, row_block_v=128, group_n=2)
    # fp32 tiles are twice the bytes: one pipeline stage fewer keeps them within shared memory.
    stages = 2 if dtype == torch.float32 else 3
    return SweepTiles(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=stages)


#: overrides of `sweep_tiles`, set only by tests that force several token blocks, vocab
#: splits and backward chunks on tiny shapes.
TILE_OVERRIDE: dict = {}


def tiles_for(dtype: torch.dtype) -> SweepTiles:
    """`sweep_tiles(dtype)` with the test overrides applied."""
    return dataclasses.replace(sweep_tiles(dtype), **TILE_OVERRIDE)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: exact fp32 products for fp32 inputs (PyTorch's default for
    matmul), tensor-core inputs as given otherwise."""
    return "ieee" if dtype == torch.float32 or dot_upcast(dtype) else "tf32"


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether kernels cast bf16 dot operands to fp32 first: only under the interpreter, whose
    tl.dot (Triton 3.9) multiplies the raw uint16 bits of bf16 arrays. bf16 -> fp32 is exact,
    so the products are the tensor-core ones; only the fp32 summation order differs."""
    return interpreting() and dtype == torch.bfloat16


def new_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor for a kernel to fill: uninitialised, or NaN when `POISON_BUFFERS` is set."""
    if POISON_BUFFERS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
