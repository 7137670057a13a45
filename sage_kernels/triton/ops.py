"""The Triton backend as `torch.library` operators, with their autograd and fake implementations.

Three operators, so that `torch.compile` can trace a model that calls the loss (the
operators are opaque to the compiler; their fake implementations give output shapes):

- ``sage_kernels::triton_sage_loss``: forward sweep + token stage. Returns the loss, the
  [B, L] per-token outputs, the metrics as one [8] vector (in `METRIC_NAMES` order) and
  what the backward needs (lse, g, c, the compacted row order and the valid count).
- ``sage_kernels::triton_sage_loss_backward``: the backward sweep.
- ``sage_kernels::triton_logprobs_entropy``: the forward-only scoring sweep.

Operators take tensors and flat lists of numbers, so `LossConfig` crosses the boundary as
(floats, ints, num_items) from `_pack` and is rebuilt (and re-validated) by `_unpack`; both walk
`LossConfig`'s fields by their declared types, so a new option needs no change here.
Nothing here reads a device value on the host: the loss and metrics stay on the device.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from ..spec import (GUIDE_CODES, IS_LEVEL_CODES, KL_CODES, LOSS_TYPE_CODES, METRIC_NAMES, LossConfig,
                    SageInputs, SageLossOutput)
from . import token_stage as stage
from .sweep_bwd import sweep_backward
from .sweep_fwd import compact_rows, scoring_forward, sweep_forward
from .tiles import interpreting

MaybeTensor = Optional[Tensor]
_CODE_TABLES = {"kl": KL_CODES, "guide": GUIDE_CODES, "loss_type": LOSS_TYPE_CODES,
                "importance_sampling": IS_LEVEL_CODES}
#: how each declared field type travels: in the float list or in the int list.
_FLOAT_TYPES = ("float", "Optional[float]", "Optional[object]")
_INT_TYPES = ("str", "bool", "Optional[int]")
_FIELDS = dataclasses.fields(LossConfig)
_FLOAT_FIELDS = tuple(f.name for f in _FIELDS if f.type in _FLOAT_TYPES)
_INT_FIELDS = tuple(f.name for f in _FIELDS if f.type in _INT_TYPES)
assert len(_FLOAT_FIELDS) + len(_INT_FIELDS) == len(_FIELDS), "a LossConfig field type _pack cannot carry"
assert set(_CODE_TABLES) == {f.name for f in _FIELDS if f.type == "str"}, "a string option without codes"
#: stands for None in the packed optional numbers (every valid value is positive).
_ABSENT = -1.0
_TEMPERATURE = _FLOAT_FIELDS.index("temperature")
_ENTROPY_COEF = _FLOAT_FIELDS.index("entropy_coef")
#: inputs of the loss operator after hidden, weight and bias: none of them gets a gradient.
_N_OTHER_INPUTS = 10


def _pack(config: LossConfig):
    """(floats, ints, num_items tensor or None) carrying every field of `config`."""
    floats = []
    for name in _FLOAT_FIELDS:
        value = getattr(config, name)
        floats.append(_ABSENT if value is None or isinstance(value, torch.Tensor) else float(value))
    ints = []
    for name in _INT_FIELDS:
        value = getattr(config, name)
        ints.append(_CODE_TABLES[name][value] if name in _CODE_TABLES else int(value or 0))
    n = config.num_items_in_batch
    return floats, ints, n if isinstance(n, torch.Tensor) else None


def _unpack(floats: list[float], ints: list[int], num_items: Optional[Tensor]) -> LossConfig:
    """The `LossConfig` that `_pack` packed."""
    options = {name: None if value == _ABSENT else value for name, value in zip(_FLOAT_FIELDS, floats)}
    types = {f.name: f.type for f in _FIELDS}
    for name, code in zip(_INT_FIELDS, ints):
        if name in _CODE_TABLES:
            options[name] = next(key for key, value in _CODE_TABLES[name].items() if value == code)
        else:
            options[name] = bool(code) if types[name] == "bool" else (code or None)
    if num_items is not None:
        options["num_items_in_batch"] = num_items
    return LossConfig(**options)


def _metrics(row_stats: Tensor, mask: Tensor) -> Tensor:
    """The [8] metric vector (METRIC_NAMES order) from the per-row partial sums."""
    tokens = mask.sum().to(torch.float32)
    denom = tokens.clamp(min=1.0)
    sums = row_stats.sum(0)
    any_token = tokens > 0
    one = torch.ones((), dtype=torch.float32, device=row_stats.device)
    return torch.stack([
        sums[stage.ROW_KL] / denom,
        sums[stage.ROW_ENTROPY] / denom,
        sums[stage.ROW_Q] / denom,
        torch.where(any_token, row_stats[:, stage.ROW_Q_MIN].min(), one),
        torch.where(any_token, row_stats[:, stage.ROW_Q_MAX].max(), one),
        sums[stage.ROW_LOW] / denom,
        sums[stage.ROW_HIGH] / denom,
        sums[stage.ROW_REGION] / denom,
    ])


def _unit_stride(t: Tensor) -> Tensor:
    """`t` itself when its rows are contiguous (the kernels take a row stride), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def loss_forward(hidden: Tensor, weight: Tensor, bias: MaybeTensor, token_ids: Tensor, mask: Tensor,
                 advantages: Tensor, old_logp: MaybeTensor, ref_logp: MaybeTensor, is_weights: MaybeTensor,
                 log_q: MaybeTensor, config: LossConfig) -> tuple[Tensor, ...]:
    """The forward pass behind the loss operator (tests call it directly: a dispatch mode sees
    the operator only as a whole). Returns the operator's twelve outputs."""
    B, L = mask.shape
    flat_mask = mask.reshape(-1)
    rows, count = compact_rows(flat_mask)
    lse, logp, entropy = sweep_forward(_unit_stride(hidden), _unit_stride(weight), bias,
                                       token_ids.reshape(-1), rows, count, config.temperature)
    lse = torch.where(flat_mask, lse, 0.0)
    logp = torch.where(flat_mask, logp, 0.0).view(B, L)
    entropy = torch.where(flat_mask, entropy, 0.0).view(B, L)
    # the token stage addresses [B, L] tensors as row-major
    old_logp, ref_logp, is_weights, log_q, advantages = (
        None if t is None else t.contiguous() for t in (old_logp, ref_logp, is_weights, log_q, advantages))
    q, kl, ratio, g, c, row_stats = stage.token_stage(logp, entropy, mask, advantages, old_logp, ref_logp,
                                                      is_weights, log_q, config)
    loss = row_stats[:, stage.ROW_LOSS].sum()
    return loss, logp, entropy, q, kl, ratio, _metrics(row_stats, mask), lse, g, c, rows, count


def loss_backward(grad_loss: Tensor, hidden: Tensor, weight: Tensor, bias: MaybeTensor, token_ids: Tensor,
                  rows: Tensor, count: Tensor, lse: Tensor, entropy: Tensor, g: Tensor, c: Tensor,
                  temperature: float, entropy_grad: bool, need_weight: bool, need_bias: bool):
    """The backward pass behind the backward operator:
    (grad_hidden, grad_weight or None, grad_bias or None)."""
    return sweep_backward(grad_loss, _unit_stride(hidden), _unit_stride(weight), bias, token_ids.reshape(-1),
                          rows, count, lse, entropy.reshape(-1), g, c, temperature, entropy_grad, need_weight,
                          need_bias)


@torch.library.custom_op("sage_kernels::triton_sage_loss", mutates_args=())
def _sage_loss_op(hidden: Tensor, weight: Tensor, bias: MaybeTensor, token_ids: Tensor, mask: Tensor,
                  advantages: Tensor, old_logp: MaybeTensor, ref_logp: MaybeTensor, is_weights: MaybeTensor,
                  log_q: MaybeTensor, num_items: MaybeTensor, floats: list[float], ints: list[int],
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                             Tensor, Tensor]:
    return loss_forward(hidden, weight, bias, token_ids, mask, advantages, old_logp, ref_logp, is_weights,
                        log_q, _unpack(floats, ints, num_items))


@_sage_loss_op.register_fake
def _sage_loss_fake(hidden, weight, bias, token_ids, mask, advantages, old_logp, ref_logp, is_weights, log_q,
                    num_items, floats, ints):
    B, L = mask.shape
    f32 = dict(dtype=torch.float32, device=hidden.device)
    per_token = [hidden.new_empty((B, L), **f32) for _ in range(5)]
    flat = [hidden.new_empty((B * L,), **f32) for _ in range(3)]
    return (hidden.new_empty((), **f32), *per_token, hidden.new_empty((len(METRIC_NAMES),), **f32), *flat,
            hidden.new_empty((B * L,), dtype=torch.int64), hidden.new_empty((), dtype=torch.int64))


@torch.library.custom_op("sage_kernels::triton_sage_loss_backward", mutates_args=())
def _sage_loss_backward_op(grad_loss: Tensor, hidden: Tensor, weight: Tensor, bias: MaybeTensor,
                           token_ids: Tensor, rows: Tensor, count: Tensor, lse: Tensor, entropy: Tensor,
                           g: Tensor, c: Tensor, temperature: float, entropy_grad: bool, need_weight: bool,
                           need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    grad_hidden, grad_weight, grad_bias = loss_backward(grad_loss, hidden, weight, bias, token_ids, rows,
                                                        count, lse, entropy, g, c, temperature, entropy_grad,
                                                        need_weight, need_bias)
    # operators return distinct tensors, never None: an empty one stands for "not computed".
    return (grad_hidden, hidden.new_empty((0,)) if grad_weight is None else grad_weight,
            hidden.new_empty((0,)) if grad_bias is None else grad_bias)


@_sage_loss_backward_op.register_fake
def _sage_loss_backward_fake(grad_loss, hidden, weight, bias, token_ids, rows, count, lse, entropy, g, c,
                             temperature, entropy_grad, need_weight, need_bias):
    return (torch.empty_like(hidden), torch.empty_like(weight) if need_weight else hidden.new_empty((0,)),
            torch.empty_like(bias) if need_bias else hidden.new_empty((0,)))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, token_ids = inputs[:4]
    floats = inputs[11]
    _, _, entropy, _, _, _, _, lse, g, c, rows, count = output
    ctx.save_for_backward(hidden, weight, bias, token_ids, rows, count, lse, entropy, g, c)
    ctx.temperature = floats[_TEMPERATURE]
    ctx.entropy_grad = floats[_ENTROPY_COEF] != 0.0


def _backward(ctx, grad_loss, *_unused_grads):
    hidden, weight, bias, token_ids, rows, count, lse, entropy, g, c = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    need_bias = need_bias and bias is not None
    none = (None,) * _N_OTHER_INPUTS
    if grad_loss is None or not (need_hidden or need_weight or need_bias):
        return (None, None, None) + none
    grad_hidden, grad_weight, grad_bias = torch.ops.sage_kernels.triton_sage_loss_backward(
        grad_loss, hidden, weight, bias, token_ids, rows, count, lse, entropy, g, c, ctx.temperature,
        ctx.entropy_grad, need_weight, need_bias)
    return (grad_hidden if need_hidden else None, grad_weight if need_weight else None,
            grad_bias if need_bias else None) + none


_sage_loss_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("sage_kernels::triton_logprobs_entropy", mutates_args=())
def _logprobs_entropy_op(hidden2d: Tensor, weight: Tensor, bias: Optional[Tensor], token_ids: Tensor,
                         temperature: float) -> tuple[Tensor, Tensor]:
    return scoring_forward(hidden2d, weight, token_ids, bias, temperature)


@_logprobs_entropy_op.register_fake
def _logprobs_entropy_fake(hidden2d, weight, bias, token_ids, temperature):
    n = hidden2d.shape[0]
    return (hidden2d.new_empty((n,), dtype=torch.float32), hidden2d.new_empty((n,), dtype=torch.float32))


def _check_device(hidden: Tensor) -> None:
    if hidden.device.type != "cuda" and not interpreting():
        raise ValueError(f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before import "
                         f"for CPU tensors); hidden is on {hidden.device}")


def sage_loss(inputs: SageInputs, config: LossConfig) -> SageLossOutput:
    """The SAGE loss of validated `inputs` with the fused Triton kernels (backend "triton")."""
    _check_device(inputs.hidden)
    floats, ints, num_items = _pack(config)
    out = torch.ops.sage_kernels.triton_sage_loss(
        inputs.hidden, inputs.weight, inputs.bias, inputs.token_ids, inputs.mask, inputs.advantages,
        inputs.old_logp, inputs.ref_logp, inputs.is_weights, inputs.log_q, num_items, floats, ints)
    loss, logp, entropy, q, kl, ratio, metrics = out[:7]
    metrics = metrics.detach()
    return SageLossOutput(loss=loss, logp=logp.detach(), entropy=entropy.detach(), q=q.detach(),
                          kl=kl.detach(), ratio=ratio.detach(),
                          metrics={name: metrics[i] for i, name in enumerate(METRIC_NAMES)})


def logprobs_and_entropy(hidden2d: Tensor, weight: Tensor, token_ids_flat: Tensor, bias: Optional[Tensor],
                         temperature: float) -> tuple[Tensor, Tensor]:
    """logp and entropy [N] in float32 for every row of `hidden2d` (no gradient)."""
    _check_device(hidden2d)
    return torch.ops.sage_kernels.triton_logprobs_entropy(hidden2d, weight, bias, token_ids_flat,
                                                          float(temperature))
