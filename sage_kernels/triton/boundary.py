"""What crosses the Triton operators' boundary, each as a named record with one flat form.

`torch.library` operators take and return flat lists of tensors and numbers, so every group of
them has a NamedTuple here with `flat()` (the operator's argument or output order) and
`from_flat()` (the record back, its length checked): the loss's tensors (`LossTensors`), the
gradients a call wants (`GradsWanted`), what each loss operator returns (`TwoPassOutputs`,
`LocalOutputs`), what the two-pass backward reads (`TwoPassSaved`) and its options
(`BackwardFlags`, passed by keyword). Code on either side names fields, never positions.

`LossConfig` crosses as (floats, ints, num_items) from `pack_config` and is rebuilt (and
re-validated) by `unpack_config`; both walk `LossConfig`'s fields by their declared types, so a
new option needs no change here. Also here: the rows in the order the kernels take them
(`row_order`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..inputs import SageInputs
from ..loss_types import LOSS_TYPE_CODES
from ..packing import layout_of
from ..spec import GUIDE_CODES, IS_LEVEL_CODES, KL_CODES, LogitMap, LossConfig
from .stage_timing import stage as timed
from .sweep_fwd import compact_rows, host_row_count

_CODE_TABLES = {
    "kl": KL_CODES,
    "guide": GUIDE_CODES,
    "loss_type": LOSS_TYPE_CODES,
    "importance_sampling": IS_LEVEL_CODES,
}
#: how each declared field type travels: in the float list or in the int list.
_FLOAT_TYPES = ("float", "float | None", "object | None")
_INT_TYPES = ("str", "bool", "int | None")
_FIELDS = dataclasses.fields(LossConfig)
FLOAT_FIELDS = tuple(f.name for f in _FIELDS if f.type in _FLOAT_TYPES)
INT_FIELDS = tuple(f.name for f in _FIELDS if f.type in _INT_TYPES)
assert len(FLOAT_FIELDS) + len(INT_FIELDS) == len(_FIELDS), "a LossConfig field type _pack cannot carry"
assert set(_CODE_TABLES) == {f.name for f in _FIELDS if f.type == "str"}, "a string option without codes"
#: stands for None in the packed optional numbers (every valid value is positive).
_ABSENT = -1.0

MaybeTensor = Tensor | None


def _checked(cls, values: Sequence):
    values = tuple(values)
    if len(values) != len(cls._fields):
        raise ValueError(f"{cls.__name__} has {len(cls._fields)} fields, got {len(values)} values")
    return cls._make(values)


class LossTensors(NamedTuple):
    """The tensors of one loss call, in the order both loss operators take them: hidden [N, D], the
    per-token tensors on the token stage's [B, L] grid, and for packed sequences the grid cell of
    each hidden row (`packing.TokenLayout`; None: row n is cell n)."""

    hidden: Tensor
    weight: Tensor
    bias: MaybeTensor
    token_ids: Tensor
    mask: Tensor
    advantages: Tensor
    old_logp: MaybeTensor
    ref_logp: MaybeTensor
    is_weights: MaybeTensor
    log_q: MaybeTensor
    sampling_logp: MaybeTensor
    cells: MaybeTensor

    @classmethod
    def of(cls, inputs: SageInputs) -> LossTensors:
        return cls(*(getattr(inputs, name) for name in cls._fields))

    def flat(self) -> tuple:
        return tuple(self)

    @classmethod
    def from_flat(cls, values: Sequence) -> LossTensors:
        return _checked(cls, values)

    def for_kernels(self) -> LossTensors:
        """Unit stride along D for hidden and weight; the [B, L] tensors row-major (the token stage
        addresses them so)."""

        def row_major(t):
            return None if t is None else t.contiguous()

        return self._replace(
            hidden=unit_stride(self.hidden),
            weight=unit_stride(self.weight),
            advantages=row_major(self.advantages),
            old_logp=row_major(self.old_logp),
            ref_logp=row_major(self.ref_logp),
            is_weights=row_major(self.is_weights),
            log_q=row_major(self.log_q),
            sampling_logp=row_major(self.sampling_logp),
        )


class GradsWanted(NamedTuple):
    """Which of hidden, weight and bias a three-matmul call forms gradients for."""

    hidden: bool
    weight: bool
    bias: bool

    @classmethod
    def of(cls, tensors: LossTensors) -> GradsWanted:
        grad_on = torch.is_grad_enabled()
        return cls(
            *(grad_on and t is not None and t.requires_grad for t in (tensors.hidden, tensors.weight, tensors.bias))
        )

    def flat(self) -> list[bool]:
        return list(self)

    @classmethod
    def from_flat(cls, values: Sequence[bool]) -> GradsWanted:
        return _checked(cls, (bool(v) for v in values))


class TwoPassOutputs(NamedTuple):
    """What ``triton_sage_loss`` returns: the loss, the [B, L] per-token outputs and the metrics vector,
    then what its backward needs (lse, g, c, the compacted row order, the valid count and, as a
    CPU tensor, the rows the host counted: -1 when nothing is masked)."""

    loss: Tensor
    logp: Tensor
    entropy: Tensor
    q: Tensor
    kl: Tensor
    ratio: Tensor
    metrics: Tensor
    lse: Tensor
    g: Tensor
    c: Tensor
    rows: Tensor
    count: Tensor
    rows_to_do: Tensor

    def flat(self) -> tuple:
        return tuple(self)

    @classmethod
    def from_flat(cls, values: Sequence) -> TwoPassOutputs:
        return _checked(cls, values)


class LocalOutputs(NamedTuple):
    """What ``triton_sage_loss_local`` returns: the loss, the [B, L] per-token outputs, the
    metrics vector and the gradients formed in the forward (empty where not wanted)."""

    loss: Tensor
    logp: Tensor
    entropy: Tensor
    q: Tensor
    kl: Tensor
    ratio: Tensor
    metrics: Tensor
    grad_hidden: Tensor
    grad_weight: Tensor
    grad_bias: Tensor

    def flat(self) -> tuple:
        return tuple(self)

    @classmethod
    def from_flat(cls, values: Sequence) -> LocalOutputs:
        return _checked(cls, values)


class TwoPassSaved(NamedTuple):
    """The tensors the two-pass backward reads, in the backward operator's order after grad_loss
    (token_ids and entropy in the hidden rows' order, as the sweeps read them)."""

    hidden: Tensor
    weight: Tensor
    bias: MaybeTensor
    token_ids: Tensor
    rows: Tensor
    count: Tensor
    lse: Tensor
    entropy: Tensor
    g: Tensor
    c: Tensor
    rows_to_do: Tensor

    @classmethod
    def of(cls, tensors: LossTensors, out: TwoPassOutputs) -> TwoPassSaved:
        layout = layout_of(tensors)
        rows = {"token_ids": layout.to_rows(tensors.token_ids), "entropy": layout.to_rows(out.entropy)}
        fields = {**tensors._asdict(), **out._asdict(), **rows}
        return cls(*(fields[name] for name in cls._fields))

    def flat(self) -> tuple:
        return tuple(self)

    @classmethod
    def from_flat(cls, values: Sequence) -> TwoPassSaved:
        return _checked(cls, values)


class BackwardFlags(NamedTuple):
    """The two-pass backward's options, passed to its operator by keyword (`flags._asdict()`); the
    first three are `spec.LogitMap`'s (`logit_map()`)."""

    logit_inner: float
    logit_outer: float
    softcap: bool
    entropy_grad: bool
    need_hidden: bool
    need_weight: bool
    need_bias: bool

    @classmethod
    def of(cls, config: LossConfig, need_hidden: bool, need_weight: bool, need_bias: bool) -> BackwardFlags:
        return cls(*config.logit_map, config.entropy_coef != 0.0, need_hidden, need_weight, need_bias)

    def logit_map(self) -> LogitMap:
        return LogitMap(self.logit_inner, self.logit_outer, self.softcap)


def pack_config(config: LossConfig):
    """(floats, ints, num_items tensor or None) carrying every field of `config`."""
    floats = []
    for name in FLOAT_FIELDS:
        value = getattr(config, name)
        floats.append(_ABSENT if value is None or isinstance(value, torch.Tensor) else float(value))
    ints = []
    for name in INT_FIELDS:
        value = getattr(config, name)
        ints.append(_CODE_TABLES[name][value] if name in _CODE_TABLES else int(value or 0))
    n = config.num_items_in_batch
    return floats, ints, n if isinstance(n, torch.Tensor) else None


def unpack_config(floats: list[float], ints: list[int], num_items: Tensor | None) -> LossConfig:
    """The `LossConfig` that `pack_config` packed."""
    options = {name: None if value == _ABSENT else value for name, value in zip(FLOAT_FIELDS, floats)}
    types = {f.name: f.type for f in _FIELDS}
    for name, code in zip(INT_FIELDS, ints):
        if name in _CODE_TABLES:
            options[name] = next(key for key, value in _CODE_TABLES[name].items() if value == code)
        else:
            options[name] = bool(code) if types[name] == "bool" else (code or None)
    if num_items is not None:
        options["num_items_in_batch"] = num_items
    return LossConfig(**options)


def unit_stride(t: Tensor) -> Tensor:
    """`t` itself when its rows are contiguous (the kernels take a row stride), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


class RowOrder(NamedTuple):
    """The rows a call covers: the flat mask, every row index valid-first, the valid count on the
    device, the rows to cover (the count read on the host, or N) and whether rows is 0..N-1."""

    flat_mask: Tensor
    rows: Tensor
    count: Tensor
    n: int
    identity: bool


def row_order(mask: Tensor) -> RowOrder:
    """The `RowOrder` of the positions where `mask` is set."""
    flat_mask = mask.reshape(-1)
    with timed("compact rows"):
        rows, count = compact_rows(flat_mask)
        n, exact = host_row_count(count, flat_mask.numel())
    return RowOrder(flat_mask, rows, count, n, exact and n == flat_mask.numel())


def none_as_empty(t: Tensor | None, like: Tensor) -> Tensor:
    # operators return distinct tensors, never None: an empty one stands for "not computed".
    return like.new_empty((0,)) if t is None else t
