"""What crosses the Triton operators' boundary: `LossConfig` as flat numbers, the rows in the
order the kernels take them, and the metrics as one vector.

Operators take tensors and flat lists of numbers, so `LossConfig` crosses the boundary as
(floats, ints, num_items) from `pack_config` and is rebuilt (and re-validated) by `unpack_config`;
both walk `LossConfig`'s fields by their declared types, so a new option needs no change here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from ..spec import GUIDE_CODES, IS_LEVEL_CODES, KL_CODES, LOSS_TYPE_CODES, LossConfig
from . import token_stage as stage
from .stages import stage as timed
from .sweep_fwd import compact_rows, host_row_count

_CODE_TABLES = {
    "kl": KL_CODES,
    "guide": GUIDE_CODES,
    "loss_type": LOSS_TYPE_CODES,
    "importance_sampling": IS_LEVEL_CODES,
}
#: how each declared field type travels: in the float list or in the int list.
_FLOAT_TYPES = ("float", "Optional[float]", "Optional[object]")
_INT_TYPES = ("str", "bool", "Optional[int]")
_FIELDS = dataclasses.fields(LossConfig)
FLOAT_FIELDS = tuple(f.name for f in _FIELDS if f.type in _FLOAT_TYPES)
INT_FIELDS = tuple(f.name for f in _FIELDS if f.type in _INT_TYPES)
assert len(FLOAT_FIELDS) + len(INT_FIELDS) == len(_FIELDS), "a LossConfig field type _pack cannot carry"
assert set(_CODE_TABLES) == {f.name for f in _FIELDS if f.type == "str"}, "a string option without codes"
#: stands for None in the packed optional numbers (every valid value is positive).
_ABSENT = -1.0
TEMPERATURE = FLOAT_FIELDS.index("temperature")
ENTROPY_COEF = FLOAT_FIELDS.index("entropy_coef")
#: inputs of the two-pass loss operator after hidden, weight and bias: none of them gets a gradient
#: (the local operator has one more, its list of needed gradients).
N_OTHER_INPUTS = 10


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


def unpack_config(floats: list[float], ints: list[int], num_items: Optional[Tensor]) -> LossConfig:
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


def metrics_vector(row_stats: Tensor, mask: Tensor) -> Tensor:
    """The [8] metric vector (METRIC_NAMES order) from the per-row partial sums."""
    tokens = mask.sum().to(torch.float32)
    denom = tokens.clamp(min=1.0)
    sums = row_stats.sum(0)
    any_token = tokens > 0
    one = torch.ones((), dtype=torch.float32, device=row_stats.device)
    return torch.stack(
        [
            sums[stage.ROW_KL] / denom,
            sums[stage.ROW_ENTROPY] / denom,
            sums[stage.ROW_Q] / denom,
            torch.where(any_token, row_stats[:, stage.ROW_Q_MIN].min(), one),
            torch.where(any_token, row_stats[:, stage.ROW_Q_MAX].max(), one),
            sums[stage.ROW_LOW] / denom,
            sums[stage.ROW_HIGH] / denom,
            sums[stage.ROW_REGION] / denom,
        ]
    )


def unit_stride(t: Tensor) -> Tensor:
    """`t` itself when its rows are contiguous (the kernels take a row stride), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def row_order(mask: Tensor):
    """(flat mask, rows valid-first, device count, rows to cover, whether rows is the identity)."""
    flat_mask = mask.reshape(-1)
    with timed("compact rows"):
        rows, count = compact_rows(flat_mask)
        n, exact = host_row_count(count, flat_mask.numel())
    return flat_mask, rows, count, n, exact and n == flat_mask.numel()


def contiguous(*tensors):
    # the token stage addresses [B, L] tensors as row-major
    return tuple(None if t is None else t.contiguous() for t in tensors)


def none_as_empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    # operators return distinct tensors, never None: an empty one stands for "not computed".
    return like.new_empty((0,)) if t is None else t
