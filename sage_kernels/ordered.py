"""Sums whose last bits do not depend on the number of CPU threads.

ATen reduces a tensor of `SERIAL_ELEMENTS` or more elements on several threads; where it
splits the reduced dimension itself (a full sum, a row sum of few long rows), each thread
sums its own share and the shares are added, so the bits change with the thread count.
`ordered_sum` first sums contiguous groups of `GROUP` elements, then the group sums, and so
on: every level has more outputs than the width it reduces, so ATen gives each output to one
thread, and the last level is below `SERIAL_ELEMENTS`, so one thread sums it. The order is
fixed by the shape alone. Below `SERIAL_ELEMENTS` it is exactly `Tensor.sum`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: ATen's grain size: reductions of fewer elements run on the calling thread alone.
SERIAL_ELEMENTS = 32768
#: elements per partial sum of a larger reduction.
GROUP = 64


def ordered_sum(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """``x.sum()`` (dim None) or ``x.sum(-1, keepdim)`` (dim -1), in an order fixed by the shape."""
    if dim is None:
        return ordered_sum(x.reshape(-1), -1)
    if dim not in (-1, x.dim() - 1):
        raise ValueError(f"ordered_sum: dim must be None or the last dimension, got {dim}")
    while x.numel() >= SERIAL_ELEMENTS and x.shape[-1] * x.shape[-1] >= x.numel():
        # the reduced length is at least the number of outputs: ATen could split it across threads
        x = F.pad(x, (0, -x.shape[-1] % GROUP)).unflatten(-1, (-1, GROUP)).sum(-1)
    return x.sum(-1, keepdim=keepdim)
