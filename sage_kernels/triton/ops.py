"""The Triton backend as `torch.library` operators, with their autograd and fake implementations.

Four operators, so that `torch.compile` can trace a model that calls the loss (the
operators are opaque to the compiler; their fake implementations give output shapes):

- ``sage_kernels::triton_sage_loss_local``: the three-matmul path (`three_matmul.py`), for
  configurations whose per-token gradient is local (`per_token_grad_is_local`; the default
  configuration is one). Returns the loss, the [B, L] per-token outputs, the metrics and the
  gradients, formed in the forward; its backward scales them by the upstream gradient in place.
- ``sage_kernels::triton_sage_loss``: the two-pass path's forward sweep + token stage, for
  sequence-level ratios and the entropy quantile. Returns the loss, the [B, L] per-token
  outputs, the metrics as one [8] vector (in `METRIC_NAMES` order) and what the backward
  needs (lse, g, c, the compacted row order, the valid count and, on the host, the rows to cover).
- ``sage_kernels::triton_sage_loss_backward``: the two-pass path's backward sweep.
- ``sage_kernels::triton_logprobs_entropy``: the forward-only scoring sweep.

`PATHS_TAKEN` counts the path each loss call took. 16-bit inputs take the three-matmul path
only where torch writes 16-bit products as fp32 (`gemm.has_fp32_output`), so logits are
never rounded to bf16.

Operators take tensors and flat lists of numbers, so `LossConfig` crosses the boundary as
(floats, ints, num_items) from `_pack` and is rebuilt (and re-validated) by `_unpack`; both walk
`LossConfig`'s fields by their declared types, so a new option needs no change here.
The loss and metrics stay on the device; the one host read of a call is the valid-token
count (`sweep_fwd.host_row_count`), which sizes the grids and GEMMs so masked tokens cost
nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from ..spec import (
    GUIDE_CODES,
    IS_LEVEL_CODES,
    KL_CODES,
    LOSS_TYPE_CODES,
    METRIC_NAMES,
    LossConfig,
    SageInputs,
    SageLossOutput,
)
from . import token_stage as stage
from .gemm import has_fp32_output, on_device
from .stages import stage as timed
from .sweep_bwd import sweep_backward
from .sweep_fwd import compact_rows, host_row_count, scoring_forward, sweep_forward
from .three_matmul import PATHS_TAKEN, fused_loss, per_token_grad_is_local
from .tiles import interpreting

MaybeTensor = Optional[Tensor]
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
_FLOAT_FIELDS = tuple(f.name for f in _FIELDS if f.type in _FLOAT_TYPES)
_INT_FIELDS = tuple(f.name for f in _FIELDS if f.type in _INT_TYPES)
assert len(_FLOAT_FIELDS) + len(_INT_FIELDS) == len(_FIELDS), "a LossConfig field type _pack cannot carry"
assert set(_CODE_TABLES) == {f.name for f in _FIELDS if f.type == "str"}, "a string option without codes"
#: stands for None in the packed optional numbers (every valid value is positive).
_ABSENT = -1.0
_TEMPERATURE = _FLOAT_FIELDS.index("temperature")
_ENTROPY_COEF = _FLOAT_FIELDS.index("entropy_coef")
#: inputs of the two-pass loss operator after hidden, weight and bias: none of them gets a gradient
#: (the local operator has one more, its list of needed gradients).
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


def _unit_stride(t: Tensor) -> Tensor:
    """`t` itself when its rows are contiguous (the kernels take a row stride), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _row_order(mask: Tensor):
    """(flat mask, rows valid-first, device count, rows to cover, whether rows is the identity)."""
    flat_mask = mask.reshape(-1)
    with timed("compact rows"):
        rows, count = compact_rows(flat_mask)
        n, exact = host_row_count(count, flat_mask.numel())
    return flat_mask, rows, count, n, exact and n == flat_mask.numel()


def _contiguous(*tensors):
    # the token stage addresses [B, L] tensors as row-major
    return tuple(None if t is None else t.contiguous() for t in tensors)


def loss_forward(
    hidden: Tensor,
    weight: Tensor,
    bias: MaybeTensor,
    token_ids: Tensor,
    mask: Tensor,
    advantages: Tensor,
    old_logp: MaybeTensor,
    ref_logp: MaybeTensor,
    is_weights: MaybeTensor,
    log_q: MaybeTensor,
    config: LossConfig,
) -> tuple[Tensor, ...]:
    """The two-pass path's forward behind the loss operator (tests call it directly: a dispatch
    mode sees the operator only as a whole). Returns the operator's first twelve outputs."""
    return _two_pass_forward(
        hidden, weight, bias, token_ids, mask, advantages, old_logp, ref_logp, is_weights, log_q, config
    )[:12]


def _two_pass_forward(hidden, weight, bias, token_ids, mask, advantages, old_logp, ref_logp, is_weights, log_q, config):
    with on_device(hidden):  # every launch (sweep, token stage) on the tensors' GPU
        return _two_pass_forward_here(
            hidden, weight, bias, token_ids, mask, advantages, old_logp, ref_logp, is_weights, log_q, config
        )


def _two_pass_forward_here(
    hidden, weight, bias, token_ids, mask, advantages, old_logp, ref_logp, is_weights, log_q, config
):
    PATHS_TAKEN["two-pass"] += 1
    B, L = mask.shape
    flat_mask, rows, count, n, identity = _row_order(mask)
    with timed("forward sweep"):
        lse, logp, entropy = sweep_forward(
            _unit_stride(hidden), _unit_stride(weight), bias, token_ids.reshape(-1), rows, count, config.temperature, n
        )
    lse = torch.where(flat_mask, lse, 0.0)
    logp = torch.where(flat_mask, logp, 0.0).view(B, L)
    entropy = torch.where(flat_mask, entropy, 0.0).view(B, L)
    old_logp, ref_logp, is_weights, log_q, advantages = _contiguous(old_logp, ref_logp, is_weights, log_q, advantages)
    with timed("token stage"):
        q, kl, ratio, g, c, row_stats = stage.token_stage(
            logp, entropy, mask, advantages, old_logp, ref_logp, is_weights, log_q, config
        )
    loss = row_stats[:, stage.ROW_LOSS].sum()
    # the host's row count travels to the backward as a CPU tensor (-1: nothing masked); reading
    # the device count there instead would wait for the whole forward
    rows_to_do = torch.full((), -1 if identity else n, dtype=torch.int64)
    return (loss, logp, entropy, q, kl, ratio, _metrics(row_stats, mask), lse, g, c, rows, count, rows_to_do)


def local_forward(
    hidden: Tensor,
    weight: Tensor,
    bias: MaybeTensor,
    token_ids: Tensor,
    mask: Tensor,
    advantages: Tensor,
    old_logp: MaybeTensor,
    ref_logp: MaybeTensor,
    is_weights: MaybeTensor,
    log_q: MaybeTensor,
    config: LossConfig,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, ...]:
    """The three-matmul path behind the local loss operator: (loss, logp, entropy, q, kl, ratio,
    metrics, grad_hidden, grad_weight, grad_bias), gradients None where not wanted."""
    B, L = mask.shape
    _, rows, count, n, identity = _row_order(mask)
    old_logp, ref_logp, is_weights, log_q, advantages = _contiguous(old_logp, ref_logp, is_weights, log_q, advantages)
    logp, entropy, q, kl, ratio, _, _, row_stats, grad_hidden, grad_weight, grad_bias = fused_loss(
        _unit_stride(hidden),
        _unit_stride(weight),
        bias,
        token_ids.reshape(-1),
        mask,
        advantages,
        old_logp,
        ref_logp,
        is_weights,
        log_q,
        config,
        rows,
        count,
        n,
        identity,
        need_hidden,
        need_weight,
        need_bias,
    )
    loss = row_stats[:, stage.ROW_LOSS].sum()
    return (
        loss,
        logp.view(B, L),
        entropy.view(B, L),
        q,
        kl,
        ratio,
        _metrics(row_stats, mask),
        grad_hidden,
        grad_weight,
        grad_bias,
    )


def loss_backward(
    grad_loss: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: MaybeTensor,
    token_ids: Tensor,
    rows: Tensor,
    count: Tensor,
    lse: Tensor,
    entropy: Tensor,
    g: Tensor,
    c: Tensor,
    temperature: float,
    entropy_grad: bool,
    need_weight: bool,
    need_bias: bool,
    need_hidden: bool = True,
    rows_to_do: Optional[int] = None,
):
    """The backward pass behind the backward operator: (grad_hidden or None, grad_weight or None,
    grad_bias or None). `rows_to_do`: the forward's host row count, -1 when no row is masked,
    None to cover every row."""
    identity = rows_to_do == -1
    n = hidden.shape[0] if identity else rows_to_do
    return sweep_backward(
        grad_loss,
        _unit_stride(hidden),
        _unit_stride(weight),
        bias,
        token_ids.reshape(-1),
        rows,
        count,
        lse,
        entropy.reshape(-1),
        g,
        c,
        temperature,
        entropy_grad,
        need_weight,
        need_bias,
        need_hidden,
        n,
        identity,
    )


@torch.library.custom_op("sage_kernels::triton_sage_loss", mutates_args=())
def _sage_loss_op(
    hidden: Tensor,
    weight: Tensor,
    bias: MaybeTensor,
    token_ids: Tensor,
    mask: Tensor,
    advantages: Tensor,
    old_logp: MaybeTensor,
    ref_logp: MaybeTensor,
    is_weights: MaybeTensor,
    log_q: MaybeTensor,
    num_items: MaybeTensor,
    floats: list[float],
    ints: list[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _two_pass_forward(
        hidden,
        weight,
        bias,
        token_ids,
        mask,
        advantages,
        old_logp,
        ref_logp,
        is_weights,
        log_q,
        _unpack(floats, ints, num_items),
    )


@_sage_loss_op.register_fake
def _sage_loss_fake(
    hidden, weight, bias, token_ids, mask, advantages, old_logp, ref_logp, is_weights, log_q, num_items, floats, ints
):
    B, L = mask.shape
    f32 = dict(dtype=torch.float32, device=hidden.device)
    per_token = [hidden.new_empty((B, L), **f32) for _ in range(5)]
    flat = [hidden.new_empty((B * L,), **f32) for _ in range(3)]
    return (
        hidden.new_empty((), **f32),
        *per_token,
        hidden.new_empty((len(METRIC_NAMES),), **f32),
        *flat,
        hidden.new_empty((B * L,), dtype=torch.int64),
        hidden.new_empty((), dtype=torch.int64),
        torch.empty((), dtype=torch.int64, device="cpu"),
    )


def _none_as_empty(t: MaybeTensor, like: Tensor) -> Tensor:
    # operators return distinct tensors, never None: an empty one stands for "not computed".
    return like.new_empty((0,)) if t is None else t


@torch.library.custom_op("sage_kernels::triton_sage_loss_backward", mutates_args=())
def _sage_loss_backward_op(
    grad_loss: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: MaybeTensor,
    token_ids: Tensor,
    rows: Tensor,
    count: Tensor,
    lse: Tensor,
    entropy: Tensor,
    g: Tensor,
    c: Tensor,
    rows_to_do: Tensor,
    temperature: float,
    entropy_grad: bool,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    grads = loss_backward(
        grad_loss,
        hidden,
        weight,
        bias,
        token_ids,
        rows,
        count,
        lse,
        entropy,
        g,
        c,
        temperature,
        entropy_grad,
        need_weight,
        need_bias,
        need_hidden,
        int(rows_to_do),
    )
    return tuple(_none_as_empty(grad, hidden) for grad in grads)


@_sage_loss_backward_op.register_fake
def _sage_loss_backward_fake(
    grad_loss,
    hidden,
    weight,
    bias,
    token_ids,
    rows,
    count,
    lse,
    entropy,
    g,
    c,
    rows_to_do,
    temperature,
    entropy_grad,
    need_hidden,
    need_weight,
    need_bias,
):
    return (
        torch.empty_like(hidden) if need_hidden else hidden.new_empty((0,)),
        torch.empty_like(weight) if need_weight else hidden.new_empty((0,)),
        torch.empty_like(bias) if need_bias else hidden.new_empty((0,)),
    )


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, token_ids = inputs[:4]
    floats = inputs[11]
    _, _, entropy, _, _, _, _, lse, g, c, rows, count, rows_to_do = output
    ctx.save_for_backward(hidden, weight, bias, token_ids, rows, count, lse, entropy, g, c, rows_to_do)
    ctx.temperature = floats[_TEMPERATURE]
    ctx.entropy_grad = floats[_ENTROPY_COEF] != 0.0


def _backward(ctx, grad_loss, *_unused_grads):
    hidden, weight, bias, token_ids, rows, count, lse, entropy, g, c, rows_to_do = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    need_bias = need_bias and bias is not None
    none = (None,) * _N_OTHER_INPUTS
    if grad_loss is None or not (need_hidden or need_weight or need_bias):
        return (None, None, None) + none
    grad_hidden, grad_weight, grad_bias = torch.ops.sage_kernels.triton_sage_loss_backward(
        grad_loss,
        hidden,
        weight,
        bias,
        token_ids,
        rows,
        count,
        lse,
        entropy,
        g,
        c,
        rows_to_do,
        ctx.temperature,
        ctx.entropy_grad,
        need_hidden,
        need_weight,
        need_bias,
    )
    return (
        grad_hidden if need_hidden else None,
        grad_weight if need_weight else None,
        grad_bias if need_bias else None,
    ) + none


_sage_loss_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("sage_kernels::triton_sage_loss_local", mutates_args=())
def _local_loss_op(
    hidden: Tensor,
    weight: Tensor,
    bias: MaybeTensor,
    token_ids: Tensor,
    mask: Tensor,
    advantages: Tensor,
    old_logp: MaybeTensor,
    ref_logp: MaybeTensor,
    is_weights: MaybeTensor,
    log_q: MaybeTensor,
    num_items: MaybeTensor,
    floats: list[float],
    ints: list[int],
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    out = local_forward(
        hidden,
        weight,
        bias,
        token_ids,
        mask,
        advantages,
        old_logp,
        ref_logp,
        is_weights,
        log_q,
        _unpack(floats, ints, num_items),
        *needs,
    )
    return out[:7] + tuple(_none_as_empty(grad, hidden) for grad in out[7:])


@_local_loss_op.register_fake
def _local_loss_fake(
    hidden,
    weight,
    bias,
    token_ids,
    mask,
    advantages,
    old_logp,
    ref_logp,
    is_weights,
    log_q,
    num_items,
    floats,
    ints,
    needs,
):
    B, L = mask.shape
    f32 = dict(dtype=torch.float32, device=hidden.device)
    per_token = [hidden.new_empty((B, L), **f32) for _ in range(5)]
    grads = [
        torch.empty_like(t) if need and t is not None else hidden.new_empty((0,))
        for t, need in zip((hidden, weight, bias), needs)
    ]
    return (hidden.new_empty((), **f32), *per_token, hidden.new_empty((len(METRIC_NAMES),), **f32), *grads)


def _local_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*output[7:])
    ctx.used = False


def _local_backward(ctx, grad_loss, *_unused_grads):
    # The gradients were formed in the forward for an upstream gradient of 1: scaled in place
    # (a copy would hold a second weight gradient at once), so one backward per forward.
    if ctx.used:
        raise RuntimeError(
            "sage_kernels triton backend: backward called twice on one loss (its gradients are "
            "formed in the forward and scaled in place once); run the loss again instead"
        )
    ctx.used = True
    grads = []
    for grad, needed in zip(ctx.saved_tensors, ctx.needs_input_grad[:3]):
        grads.append(grad.mul_(grad_loss) if needed and grad_loss is not None and grad.numel() else None)
    return (*grads,) + (None,) * (_N_OTHER_INPUTS + 1)


_local_loss_op.register_autograd(_local_backward, setup_context=_local_setup_context)


@torch.library.custom_op("sage_kernels::triton_logprobs_entropy", mutates_args=())
def _logprobs_entropy_op(
    hidden2d: Tensor, weight: Tensor, bias: Optional[Tensor], token_ids: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    return scoring_forward(hidden2d, weight, token_ids, bias, temperature)


@_logprobs_entropy_op.register_fake
def _logprobs_entropy_fake(hidden2d, weight, bias, token_ids, temperature):
    n = hidden2d.shape[0]
    return (hidden2d.new_empty((n,), dtype=torch.float32), hidden2d.new_empty((n,), dtype=torch.float32))


def _check_device(hidden: Tensor) -> None:
    if hidden.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before import "
            f"for CPU tensors); hidden is on {hidden.device}"
        )


def takes_three_matmul_path(inputs: SageInputs, config: LossConfig) -> bool:
    """Whether a loss call with `inputs` and `config` runs the three-matmul path."""
    return per_token_grad_is_local(config) and has_fp32_output(inputs.hidden.dtype, inputs.hidden.device)


def sage_loss(inputs: SageInputs, config: LossConfig) -> SageLossOutput:
    """The SAGE loss of validated `inputs` with the fused Triton kernels (backend "triton")."""
    _check_device(inputs.hidden)
    floats, ints, num_items = _pack(config)
    args = (
        inputs.hidden,
        inputs.weight,
        inputs.bias,
        inputs.token_ids,
        inputs.mask,
        inputs.advantages,
        inputs.old_logp,
        inputs.ref_logp,
        inputs.is_weights,
        inputs.log_q,
        num_items,
        floats,
        ints,
    )
    if takes_three_matmul_path(inputs, config):
        grad_on = torch.is_grad_enabled()
        needs = [grad_on and t is not None and t.requires_grad for t in (inputs.hidden, inputs.weight, inputs.bias)]
        out = torch.ops.sage_kernels.triton_sage_loss_local(*args, needs)
    else:
        out = torch.ops.sage_kernels.triton_sage_loss(*args)
    loss, logp, entropy, q, kl, ratio, metrics = out[:7]
    metrics = metrics.detach()
    return SageLossOutput(
        loss=loss,
        logp=logp.detach(),
        entropy=entropy.detach(),
        q=q.detach(),
        kl=kl.detach(),
        ratio=ratio.detach(),
        metrics={name: metrics[i] for i, name in enumerate(METRIC_NAMES)},
    )


def logprobs_and_entropy(
    hidden2d: Tensor, weight: Tensor, token_ids_flat: Tensor, bias: Optional[Tensor], temperature: float
) -> tuple[Tensor, Tensor]:
    """logp and entropy [N] in float32 for every row of `hidden2d` (no gradient)."""
    _check_device(hidden2d)
    return torch.ops.sage_kernels.triton_logprobs_entropy(hidden2d, weight, bias, token_ids_flat, float(temperature))
