"""Packed sequences (flash-attention's varlen layout) and the map from their token rows to the token
stage's [S, L] grid: the one home of packing for every backend and adapter.

A packed call holds S sequences back to back in one stream of N tokens. ``cu_seqlens`` [S + 1]
(int32 or int64, on hidden's device) starts at 0, ends at N and never decreases; sequence s is
tokens cu_seqlens[s] .. cu_seqlens[s + 1] - 1, and empty sequences are allowed. The vocabulary
sweeps work on token rows, which packing leaves alone: `hidden` stays [N, D] and is never copied
into a padded [S, L, D] tensor, and the logits are never formed. Only the per-token stage (guide,
ratios, row sums, aggregation) needs sequences, and it reads its per-token values from an [S, L]
grid, L the longest sequence: the padded call's layout for the same sequences, so every loss type,
option and metric means what it means there (dr_grpo's default length too: L counts every token of
the longest sequence, prompt tokens included). The grid holds O(S L) scalars per per-token tensor,
as the padded call's inputs would; the [N, D] and [N, V] work stays on the flat rows.

`TokenLayout` is that map, with the padded layout as its identity case; `validate_packed_inputs`
checks a packed call and returns the `SageInputs` the backends take: per-token tensors on the grid,
and ``cells``, the grid cell of each hidden row. Reading cu_seqlens is one host read of S + 1
integers per call (the grid's shape depends on it): on CUDA, one synchronisation.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .inputs import SageInputs, SageLossOutput, check_tensor, validate_inputs

#: the per-token outputs of `SageLossOutput`, [B, L] from the backends, [N] to a packed caller.
PER_TOKEN_OUTPUTS = ("logp", "entropy", "q", "kl", "ratio")


class TokenLayout(NamedTuple):
    """Where each hidden row sits in the token stage's [B, L] grid: row n at cell n (the padded
    layout: `cells` None) or at cells[n] = s L + t, token t of sequence s (packed)."""

    shape: tuple[int, int]
    cells: torch.Tensor | None

    def to_grid(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-row values [N] on the [B, L] grid, 0 (False) at the cells no row holds; differentiable."""
        if self.cells is None:
            return rows.reshape(self.shape)
        grid = rows.new_zeros(self.shape[0] * self.shape[1])
        return grid.index_copy(0, self.cells, rows).view(self.shape)

    def to_rows(self, grid: torch.Tensor) -> torch.Tensor:
        """Grid values ([B, L] or flat [B*L]) at the hidden rows, [N]; differentiable."""
        flat = grid.reshape(-1)
        return flat if self.cells is None else flat.index_select(0, self.cells)


def layout_of(holder) -> TokenLayout:
    """The `TokenLayout` of a `SageInputs` (or of anything with its ``mask`` and ``cells``)."""
    return TokenLayout(tuple(holder.mask.shape), holder.cells)


def read_cu_seqlens(cu_seqlens, tokens: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens on the host (int64) after every check of the layout; one error naming it otherwise."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"cu_seqlens must have dtype int32 or int64 (flash-attention's varlen layout), got {cu_seqlens.dtype}"
        )
    check_tensor("cu_seqlens", cu_seqlens, ndim=(1,), device=device)
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must have S + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    bounds = cu_seqlens.to("cpu", torch.int64)
    if int(bounds[0]) != 0 or int(bounds[-1]) != tokens:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at N = {tokens} (the tokens of token_ids), "
            f"got {int(bounds[0])} ... {int(bounds[-1])}"
        )
    outside = ((bounds < 0) | (bounds > tokens)).nonzero()
    if outside.numel():
        at = int(outside[0])
        raise ValueError(f"cu_seqlens must stay within [0, N={tokens}], got {int(bounds[at])} at index {at}")
    falls = (bounds.diff() < 0).nonzero()
    if falls.numel():
        at = int(falls[0])
        raise ValueError(
            f"cu_seqlens must be non-decreasing, got {int(bounds[at])} then {int(bounds[at + 1])} at index {at}"
        )
    return bounds


def packed_layout(cu_seqlens, tokens: int, device: torch.device) -> TokenLayout:
    """The `TokenLayout` of `cu_seqlens` for a stream of `tokens` tokens on `device`, after its checks."""
    lengths = read_cu_seqlens(cu_seqlens, tokens, device).diff()
    S, L = lengths.numel(), int(lengths.max())
    starts = cu_seqlens.long()
    sequence = torch.repeat_interleave(torch.arange(S, device=device), starts.diff(), output_size=tokens)
    cells = sequence * L + torch.arange(tokens, device=device) - starts.index_select(0, sequence)
    return TokenLayout((S, L), cells)


def holds_sequences(name: str, value: torch.Tensor, sequences: int, tokens: int, ambiguous) -> bool:
    """True when `value` has one entry per sequence ([S] or [S, 1]), False per token ([N] or [1, N]).

    A 1-D tensor of length S = N reads both ways unless every sequence has one token; `ambiguous()`
    (called only then, it may read the host) says whether some sequence has not, and then the error
    asks for [S, 1] or [1, N]."""
    shape = tuple(value.shape)
    by_sequence, by_token = shape in ((sequences,), (sequences, 1)), shape in ((tokens,), (1, tokens))
    if not (by_sequence or by_token):
        raise ValueError(
            f"{name} must have shape [S={sequences}] (or [S, 1]) per sequence or [N={tokens}] (or [1, N]) "
            f"per token, got {shape}"
        )
    if by_sequence and by_token and len(shape) == 1 and ambiguous():
        raise ValueError(
            f"{name} of shape {shape} is ambiguous: S = N = {tokens} with empty sequences; "
            f"pass [S, 1] for one value per sequence or [1, N] for one per token"
        )
    return by_sequence


def per_token(name: str, value: torch.Tensor, cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """`value` per sequence ([S], [S, 1]) or per token ([N], [1, N]) as one value per token, [N];
    `cu_seqlens` checked already (no host read unless S = N)."""
    lengths = cu_seqlens.long().diff()
    sequences = lengths.numel()
    if not holds_sequences(name, value, sequences, tokens, lambda: bool((lengths != 1).any())):
        return value.reshape(tokens)
    return torch.repeat_interleave(value.reshape(sequences), lengths, output_size=tokens)


def on_grid(layout: TokenLayout, name: str, value, device: torch.device) -> torch.Tensor | None:
    """A packed per-token tensor ([N] or [1, N], checked) on `layout`'s [S, L] grid; None stays None."""
    if value is None:
        return None
    check_tensor(name, value, device=device)
    tokens = layout.cells.numel()
    if tuple(value.shape) not in ((tokens,), (1, tokens)):
        shape = tuple(value.shape)
        raise ValueError(
            f"{name} must have shape [N={tokens}] or [1, N={tokens}], one value per packed token, got {shape}"
        )
    return layout.to_grid(value.reshape(tokens))


def validate_packed_inputs(
    hidden,
    weight,
    token_ids,
    mask,
    advantages,
    *,
    cu_seqlens,
    config,
    bias=None,
    allowed_dtypes,
    **per_token_inputs,
) -> SageInputs:
    """`inputs.validate_inputs` for a packed call (the module docstring gives the layout): hidden
    [N, D] or [1, N, D]; token_ids, mask and the per-token inputs [N] or [1, N]; advantages
    [S] (or [S, 1]) per sequence or [N] (or [1, N]) per token. Returns `SageInputs` on the grid."""
    if config.luspo_include_padding:
        raise ValueError(
            "luspo_include_padding must be False with cu_seqlens: packed sequences have no padded positions to sum"
        )
    check_tensor("hidden", hidden, ndim=(2, 3), float_=True)
    device = hidden.device
    check_tensor("token_ids", token_ids, ndim=(1, 2), device=device)
    tokens = token_ids.shape[-1]
    if token_ids.dim() == 2 and token_ids.shape[0] != 1:
        raise ValueError(f"token_ids must have shape [N] or [1, N] with cu_seqlens, got {tuple(token_ids.shape)}")
    if tokens == 0:
        raise ValueError("token_ids must have N >= 1 tokens; skip the loss for a batch without tokens")
    if tuple(hidden.shape[:-1]) not in ((tokens,), (1, tokens)):
        shape = tuple(hidden.shape)
        raise ValueError(
            f"hidden must have shape [N={tokens}, D] or [1, N={tokens}, D] to match token_ids, got {shape}"
        )
    layout = packed_layout(cu_seqlens, tokens, device)
    sequences, longest = layout.shape
    check_tensor("advantages", advantages, ndim=(1, 2), device=device, float_=True)
    if holds_sequences("advantages", advantages, sequences, tokens, lambda: longest > 1):
        advantages = advantages.reshape(sequences)
    else:
        advantages = on_grid(layout, "advantages", advantages, device)
    return validate_inputs(
        hidden.reshape(tokens, hidden.shape[-1]),
        weight,
        on_grid(layout, "token_ids", token_ids, device),
        on_grid(layout, "mask", mask, device),
        advantages,
        bias=bias,
        config=config,
        allowed_dtypes=allowed_dtypes,
        cells=layout.cells,
        **{name: on_grid(layout, name, value, device) for name, value in per_token_inputs.items()},
    )


def rows_output(out: SageLossOutput, inputs: SageInputs, shape: tuple) -> SageLossOutput:
    """A backend's output on the grid with its per-token tensors back on the token rows, in `shape`."""
    layout = layout_of(inputs)
    return dataclasses.replace(
        out, **{name: layout.to_rows(getattr(out, name)).reshape(shape) for name in PER_TOKEN_OUTPUTS}
    )


def check_scoring_layout(token_ids: torch.Tensor, cu_seqlens, device: torch.device) -> None:
    """The checks of `logprobs_and_entropy` with cu_seqlens: token_ids [N] or [1, N], cu_seqlens valid."""
    if token_ids.dim() == 2 and token_ids.shape[0] != 1:
        raise ValueError(f"token_ids must have shape [N] or [1, N] with cu_seqlens, got {tuple(token_ids.shape)}")
    read_cu_seqlens(cu_seqlens, token_ids.numel(), device)
