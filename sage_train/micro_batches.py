"""Micro-batches of a step's sequences: which rows go together, and how the decoder sees them.

Which rows (`split`). ``micro_batch_size`` rows at a time, in order; or, with
``max_tokens_per_micro_batch`` > 0, a token budget (verl's dynamic batch size): the fewest
micro-batches that each hold at most that many tokens, the rows dealt longest first to the
micro-batch holding the fewest tokens so far, so that long and short completions share them evenly.
A sequence's tokens are its prompt's and its completion's, padding not counted (as verl counts
them); a sequence longer than the budget gets a micro-batch of its own. Every rank runs as many
micro-batches as the rank that needs the most (ZeRO-3 gathers weights in each forward, so the ranks'
forwards must pair up); the loss's normalisers are the step's (`sage_train.step`), so the gradient
does not depend on how the rows are split.

How the decoder sees them. Padded: the micro-batch's rows of the step's `Batch` (left-padded
prompts, right-padded completions, as wide as the step's longest). Packed (``padding_free``,
`PackedRows`): one row holding the micro-batch's sequences back to back, each its prompt then its
completion, positions restarting at 0 for each and no attention mask; the model's attention keeps
each sequence to itself (`sage_train.models.loading.packs_sequences` decides whether it does). The decoder
then computes no padding, and the loss takes the completion tokens' hidden states with
``cu_seqlens`` (`sage_kernels.packing`). Log-probs and every per-token tensor of the step stay on
the step's [B, L] completion grid; a micro-batch reads its tokens from it and writes them back.

Planning reads the rows' token counts to the host once per call (one synchronisation on CUDA);
the padded layout with a fixed row count reads nothing.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sage_kernels.packing import TokenLayout

from .errors import ConfigError
from .models.loading import packs_sequences


@dataclass
class PackedRows:
    """A micro-batch's sequences packed into one row. Completion token n (in sequence order) is
    predicted by the packed row's hidden state at ``hidden_rows[n]``; ``cu_seqlens`` [S + 1] bounds
    each sequence's completion tokens; ``cells`` places token n on the step's [B, L] completion grid
    and ``grid`` on the micro-batch's own [S, L] grid (a padded micro-batch's layout, where a guide
    computed outside the loss reads its rows)."""

    input_ids: torch.Tensor  # [1, T]: every prompt and completion token of the micro-batch
    position_ids: torch.Tensor  # [1, T]: 0, 1, ... within each sequence
    hidden_rows: torch.Tensor  # [N]
    cu_seqlens: torch.Tensor  # [S + 1], int32
    cells: torch.Tensor  # [N]
    grid: TokenLayout


@dataclass
class MicroBatch:
    """Rows of the step's `Batch`: a slice (fixed row counts) or their indices, with their packed
    layout when ``padding_free`` is on (else the decoder sees the padded rows)."""

    rows: slice | torch.Tensor
    size: int
    packed: PackedRows | None = None

    def model_inputs(self, batch, temperature: float) -> dict:
        """The `PolicyHead` forward's inputs for these rows."""
        if self.packed is None:
            return batch.model_inputs(self.rows, temperature)
        packed = self.packed
        return {
            "input_ids": packed.input_ids,
            "attention_mask": None,  # transformers derives the block-diagonal mask from position_ids
            "position_ids": packed.position_ids,
            "completion_ids": self.tokens(batch.completion_ids),
            "temperature": temperature,
            "packing": packed,
        }

    def tokens(self, values: torch.Tensor) -> torch.Tensor:
        """These rows' part of a per-token tensor on the step's [B, L] grid: [rows, L] padded, [N] packed."""
        if self.packed is None:
            return values[self.rows]
        return values.reshape(-1).index_select(0, self.packed.cells)

    def put(self, grid: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` (as `tokens` gives them) into the step's [B, L] `grid`."""
        if self.packed is None:
            grid[self.rows] = values
        else:
            grid.view(-1).index_copy_(0, self.packed.cells, values)


#: attention implementations whose packed row costs what its sequences cost alone: flash-attention's
#: varlen kernel (boundaries from the position ids) and flex attention's block mask skip the pairs of
#: tokens in different sequences. eager and sdpa compute a dense [T, T] mask over the whole packed row:
#: (sum of lengths)^2 scores where the padded rows cost rows x width^2, more than the padding saves at
#: the demo's and SmolLM2's settings (benchmarks/README.md, "Padded against packed").
SEQUENCE_LOCAL_ATTENTION = ("flash_attention", "flex_attention")


def padding_free(shape, luspo_include_padding: bool, lm) -> tuple[bool, str]:
    """(whether the run packs its micro-batches, why not when the options or the model prevent it),
    given the RL step's shape (a `context.StepSettings`) and the loss option
    ``luspo_include_padding``: ``padding_free`` true packs when the loss options and `lm`'s attention
    allow it (refused naming the key where they do not); null packs where, in addition, the attention
    computes no pair of tokens from two sequences (`SEQUENCE_LOCAL_ATTENTION`) or each micro-batch is
    one sequence (a plain causal row, no padding)."""
    if shape.padding_free is False:
        return False, "padding_free: false"
    attention = str(getattr(getattr(lm, "config", None), "_attn_implementation", None) or "its attention")
    one_sequence = shape.micro_batch_size == 1 and not shape.max_tokens_per_micro_batch
    if shape.padding_free is None and not one_sequence and not any(n in attention for n in SEQUENCE_LOCAL_ATTENTION):
        return False, ""  # a choice of cost, not a limit of the model: nothing to report
    why_not = ""
    if luspo_include_padding:
        why_not = "luspo_include_padding sums the loss over padded positions, which packed sequences have none of"
    elif not packs_sequences(lm):
        why_not = (
            f"{type(lm).__name__} ({attention}) does not compute sequences packed in one row as it computes "
            "them alone (`sage_train.models.loading.packs_sequences`)"
        )
    if why_not and shape.padding_free:
        raise ConfigError(f"config key 'padding_free' must be false or null here: {why_not}")
    return not why_not, why_not


def split(batch, *, rows: int, max_tokens: int = 0, packed: bool = False, world: int = 1) -> list[MicroBatch]:
    """The micro-batches of `batch` (module docstring): `rows` rows at a time, or a budget of
    `max_tokens` tokens (> 0); packed into one row each when `packed`."""
    if not packed and not max_tokens:
        return [
            MicroBatch(slice(start, start + rows), min(rows, batch.rows - start))
            for start in range(0, batch.rows, rows)
        ]
    lengths = sequence_lengths(batch)
    if max_tokens:
        groups = token_budget_groups(lengths.sum(1), max_tokens, batch.input_ids.device, world)
    else:
        groups = list(torch.arange(batch.rows).split(rows))
    device = batch.input_ids.device
    return [
        MicroBatch(group.to(device), len(group), pack(batch, group, lengths) if packed else None) for group in groups
    ]


def sequence_lengths(batch) -> torch.Tensor:
    """[B, 2] on the host: each row's prompt and completion tokens (padding not counted)."""
    P = batch.prompt_length
    mask = batch.attention_mask
    return torch.stack([mask[:, :P].sum(1), mask[:, P:].sum(1)], 1).cpu()


def token_budget_groups(tokens: torch.Tensor, budget: int, device: torch.device, world: int) -> list[torch.Tensor]:
    """Row indices (host, ascending) of each micro-batch under a budget of `budget` tokens: the
    fewest micro-batches that `deal` keeps within it (a row over it alone), as many on every rank
    as on the rank that needs the most."""
    count = max(1, -(-int(tokens.sum()) // budget))
    while True:
        groups = deal(tokens, count)
        if all(len(g) == 1 or int(tokens[g].sum()) <= budget for g in groups):
            break
        count += 1  # at most one row per micro-batch ends it
    if world > 1:
        most = torch.tensor([count], device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        if int(most) > count:  # never more than the rows, which every rank has as many of
            groups = deal(tokens, int(most))
    return groups


def deal(tokens: torch.Tensor, count: int) -> list[torch.Tensor]:
    """`count` groups of row indices (each ascending, none empty when count <= rows): the rows,
    most tokens first (ties by index), each to the group holding the fewest tokens (then rows, then
    the lowest index): the longest-processing-time rule, within 4/3 of the most even split."""
    sizes = tokens.tolist()
    heap = [(0, 0, group) for group in range(count)]
    members: list[list[int]] = [[] for _ in range(count)]
    for row in sorted(range(len(sizes)), key=lambda row: (-sizes[row], row)):
        load, size, group = heapq.heappop(heap)
        members[group].append(row)
        heapq.heappush(heap, (load + sizes[row], size + 1, group))
    return [torch.tensor(sorted(m), dtype=torch.long) for m in members if m]


def pack(batch, rows: torch.Tensor, lengths: torch.Tensor) -> PackedRows:
    """`rows` (host indices) of `batch` packed into one row; `lengths` from `sequence_lengths`."""
    P, L = batch.prompt_length, batch.completion_ids.shape[1]
    prompt, completion = lengths[rows, 0], lengths[rows, 1]
    if (prompt == 0).any():
        row = int(rows[(prompt == 0).nonzero()[0]])
        raise ValueError(f"padding_free: row {row} has no prompt token to predict its completion's first token from")
    scored = completion.clone()
    if int(scored.sum()) == 0:  # every completion empty: one masked slot, as the padded layout's pad column
        scored[0] = 1
    sizes = prompt + completion
    S, T = len(rows), int(sizes.sum())
    starts = sizes.cumsum(0) - sizes
    sequence = torch.repeat_interleave(torch.arange(S), sizes, output_size=T)
    position = torch.arange(T) - starts[sequence]
    # the token's column in the step's padded row: its prompt ends at P, its completion starts there
    column = P - prompt[sequence] + position
    token = rows[sequence] * (P + L) + column
    owner = torch.repeat_interleave(torch.arange(S), scored)
    step = torch.arange(len(owner)) - (scored.cumsum(0) - scored)[owner]  # the token's index in its completion
    hidden_rows = starts[owner] + prompt[owner] + step - 1  # the state before the token predicts it
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), scored.cumsum(0)]).to(torch.int32)
    device = batch.input_ids.device
    return PackedRows(
        input_ids=batch.input_ids.reshape(-1).index_select(0, token.to(device))[None],
        position_ids=position.to(device)[None],
        hidden_rows=hidden_rows.to(device),
        cu_seqlens=cu_seqlens.to(device),
        cells=(rows[owner] * L + step).to(device),
        grid=TokenLayout((S, L), (owner * L + step).to(device)),
    )
