"""Packed batches for the tests: cu_seqlens of given sequence lengths, and the padded [S, L] copy of
a packed per-token tensor and back, by plain slicing (independent of `sage_kernels.packing`)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st


def cu_of(lengths, dtype=torch.int64) -> torch.Tensor:
    """cu_seqlens [S + 1] of sequences of `lengths`: 0, then the running sums."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=dtype)


def pad(rows: torch.Tensor, lengths, fill=0) -> torch.Tensor:
    """Packed [N, ...] values as [S, max(lengths), ...], sequence s in row s from column 0, `fill` after."""
    grid = rows.new_full((len(lengths), max(lengths), *rows.shape[1:]), fill)
    start = 0
    for s, n in enumerate(lengths):
        grid[s, :n] = rows[start : start + n]
        start += n
    return grid


def unpad(grid: torch.Tensor, lengths) -> torch.Tensor:
    """The inverse of `pad`: each row's first lengths[s] entries, one after the other, [N, ...]."""
    return torch.cat([grid[s, :n] for s, n in enumerate(lengths)])


def lengths_strategy(max_sequences: int = 5, max_length: int = 7):
    """Sequence lengths 0..max_length, at least one token in all (empty sequences allowed)."""
    return st.lists(st.integers(0, max_length), min_size=1, max_size=max_sequences).filter(lambda n: sum(n) > 0)
