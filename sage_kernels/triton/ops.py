"""The Triton backend as `torch.library` operators, with their autograd and fake implementations.

Four operators, so that `torch.compile` can trace a model that calls the loss (the
operators are opaque to the compiler; their fake implementations give output shapes):

- ``sage_kernels::triton_sage_loss_local`` (`ops_three_matmul.py`): the three-matmul path (`three_matmul.py`), for
  configurations whose per-token gradient is local (`three_matmul.exact_for`; the default
  configuration is one). Returns the loss, the [B, L] per-token outputs, the metrics and the
  gradients, formed in the forward; its backward scales them by the upstream gradient in place.
- ``sage_kernels::triton_sage_loss``: the two-pass path's forward sweep + token stage, for
  sequence-level ratios and the entropy quantile. Returns the loss, the [B, L] per-token
  outputs, the metrics as one vector (in `metrics.METRIC_NAMES` order) and what the backward
  needs (lse, g, c, the compacted row order, the valid count and, on the host, the rows to cover).
- ``sage_kernels::triton_sage_loss_backward``: the two-pass path's backward sweep.
- ``sage_kernels::triton_logprobs_entropy``: the forward-only scoring sweep.

`PATHS_TAKEN` counts the path each loss call took. bf16 inputs take the three-matmul path
only where torch writes 16-bit products as fp32 (`gemm.has_fp32_output`), so logits are
never rounded to bf16. fp16 inputs always take the two-pass path: the three-matmul path rounds
d(logits) to the input dtype in the forward, before the upstream gradient is known, and fp16's
range needs that gradient's loss scale (torch.amp.GradScaler) applied first. At a batch-sized
normaliser the per-token gradient is ~1e-4 and g * p falls below fp16's smallest number over
most of the vocabulary; the two-pass backward forms d(logits) from g * grad_loss.

Operators take tensors and flat lists of numbers: `boundary.py` names each group of them (a
record with `flat()` / `from_flat()`) and carries `LossConfig` across.
The loss and metrics stay on the device; the one host read of a call is the valid-token
count (`sweep_fwd.host_row_count`), which sizes the grids and GEMMs so masked tokens cost
nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..first_order import first_order_only
from ..inputs import SageInputs, SageLossOutput
from ..metrics import COLUMNS, METRIC_NAMES, metrics_vector
from ..packing import layout_of
from ..spec import LogitMap, LossConfig, logit_map
from . import ops_three_matmul  # noqa: F401  (registers the three-matmul operator)
from . import token_stage as stage
from .boundary import (
    BackwardFlags,
    GradsWanted,
    LocalOutputs,
    LossTensors,
    MaybeTensor,
    TwoPassOutputs,
    TwoPassSaved,
    none_as_empty,
    pack_config,
    row_order,
    unpack_config,
)
from .gemm import has_fp32_output, on_device
from .stage_timing import stage as timed
from .sweep_bwd import sweep_backward
from .sweep_fwd import scoring_forward, sweep_forward
from .three_matmul import PATHS_TAKEN, exact_for
from .tiles import check_device


def loss_forward(tensors: LossTensors, config: LossConfig) -> TwoPassOutputs:
    """The two-pass path's forward behind the loss operator (tests call it directly: a dispatch
    mode sees the operator only as a whole), every launch on the tensors' GPU."""
    with on_device(tensors.hidden):
        return _two_pass_forward(tensors.for_kernels(), config)


def _two_pass_forward(tensors: LossTensors, config: LossConfig) -> TwoPassOutputs:
    PATHS_TAKEN["two-pass"] += 1
    mask, layout = tensors.mask, layout_of(tensors)
    # the swept rows are those that enter the loss: every one under luspo_include_padding
    order = row_order(layout.to_rows(torch.ones_like(mask) if config.luspo_include_padding else mask))
    with timed("forward sweep"):
        lse, logp, entropy = sweep_forward(
            tensors.hidden,
            tensors.weight,
            tensors.bias,
            layout.to_rows(tensors.token_ids),
            order.rows,
            order.count,
            config.logit_map,
            order.n,
        )
    lse = torch.where(order.flat_mask, lse, 0.0)
    logp = layout.to_grid(torch.where(order.flat_mask, logp, 0.0))
    entropy = layout.to_grid(torch.where(order.flat_mask, entropy, 0.0))
    with timed("token stage"):
        per_token = stage.token_stage(logp, entropy, tensors, config)
    # the host's row count travels to the backward as a CPU tensor (-1: nothing masked); reading
    # the device count there instead would wait for the whole forward
    rows_to_do = torch.full((), -1 if order.identity else order.n, dtype=torch.int64)
    return TwoPassOutputs(
        loss=per_token.row_stats[:, COLUMNS.loss].sum(),
        logp=logp,
        entropy=entropy,
        q=per_token.q,
        kl=per_token.kl,
        ratio=per_token.ratio,
        metrics=metrics_vector(per_token.row_stats, mask),
        lse=lse,
        g=layout.to_rows(per_token.g),
        c=layout.to_rows(per_token.c),
        rows=order.rows,
        count=order.count,
        rows_to_do=rows_to_do,
    )


def loss_backward(grad_loss: Tensor, saved: TwoPassSaved, flags: BackwardFlags):
    """The backward pass behind the backward operator: (grad_hidden or None, grad_weight or None,
    grad_bias or None). `saved.rows_to_do`: the forward's host row count, -1 when no row is
    masked."""
    rows_to_do = int(saved.rows_to_do)
    identity = rows_to_do == -1
    return sweep_backward(
        grad_loss,
        saved.hidden,
        saved.weight,
        saved.bias,
        saved.token_ids.reshape(-1),
        saved.rows,
        saved.count,
        saved.lse,
        saved.entropy.reshape(-1),
        saved.g,
        saved.c,
        flags.logit_map(),
        flags.entropy_grad,
        need_weight=flags.need_weight,
        need_bias=flags.need_bias,
        need_hidden=flags.need_hidden,
        rows_to_do=saved.hidden.shape[0] if identity else rows_to_do,
        rows_are_identity=identity,
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
    sampling_logp: MaybeTensor,
    cells: MaybeTensor,
    num_items: MaybeTensor,
    floats: list[float],
    ints: list[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    tensors = LossTensors(
        hidden, weight, bias, token_ids, mask, advantages, old_logp, ref_logp, is_weights, log_q, sampling_logp, cells
    )
    return loss_forward(tensors, unpack_config(floats, ints, num_items)).flat()


@_sage_loss_op.register_fake
def _sage_loss_fake(*args):
    tensors = LossTensors.from_flat(args[: len(LossTensors._fields)])
    B, L = tensors.mask.shape
    hidden = tensors.hidden
    N = hidden.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    per_token = [hidden.new_empty((B, L), **f32) for _ in range(5)]
    flat = [hidden.new_empty((N,), **f32) for _ in range(3)]
    return (
        hidden.new_empty((), **f32),
        *per_token,
        hidden.new_empty((len(METRIC_NAMES),), **f32),
        *flat,
        hidden.new_empty((N,), dtype=torch.int64),
        hidden.new_empty((), dtype=torch.int64),
        torch.empty((), dtype=torch.int64, device="cpu"),
    )


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
    *,
    logit_inner: float,
    logit_outer: float,
    softcap: bool,
    entropy_grad: bool,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    saved = TwoPassSaved(hidden, weight, bias, token_ids, rows, count, lse, entropy, g, c, rows_to_do)
    flags = BackwardFlags(logit_inner, logit_outer, softcap, entropy_grad, need_hidden, need_weight, need_bias)
    return tuple(none_as_empty(grad, hidden) for grad in loss_backward(grad_loss, saved, flags))


@_sage_loss_backward_op.register_fake
def _sage_loss_backward_fake(grad_loss, *saved, need_hidden, need_weight, need_bias, **_logits_and_entropy):
    saved = TwoPassSaved.from_flat(saved)
    hidden = saved.hidden
    return (
        torch.empty_like(hidden) if need_hidden else hidden.new_empty((0,)),
        torch.empty_like(saved.weight) if need_weight else hidden.new_empty((0,)),
        torch.empty_like(saved.bias) if need_bias else hidden.new_empty((0,)),
    )


def _setup_context(ctx, inputs, output):
    tensors = LossTensors.from_flat(inputs[: len(LossTensors._fields)])
    floats, ints = inputs[len(LossTensors._fields) + 1 :]  # after the tensors, num_items
    ctx.save_for_backward(*TwoPassSaved.of(tensors, TwoPassOutputs.from_flat(output)).flat())
    ctx.n_inputs = len(inputs)
    ctx.config = unpack_config(floats, ints, None)
    ctx.set_materialize_grads(False)  # only the loss takes a gradient: no zeros for the other outputs


@first_order_only("triton backend")
def _backward(ctx, grad_loss, *_unused_grads):
    saved = TwoPassSaved.from_flat(ctx.saved_tensors)
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    need_bias = need_bias and saved.bias is not None
    none = (None,) * (ctx.n_inputs - 3)
    if grad_loss is None or not (need_hidden or need_weight or need_bias):
        return (None, None, None) + none
    flags = BackwardFlags.of(ctx.config, need_hidden, need_weight, need_bias)
    grad_hidden, grad_weight, grad_bias = torch.ops.sage_kernels.triton_sage_loss_backward(
        grad_loss, *saved.flat(), **flags._asdict()
    )
    return (
        grad_hidden if need_hidden else None,
        grad_weight if need_weight else None,
        grad_bias if need_bias else None,
    ) + none


_sage_loss_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("sage_kernels::triton_logprobs_entropy", mutates_args=())
def _logprobs_entropy_op(
    hidden2d: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    token_ids: Tensor,
    logit_inner: float,
    logit_outer: float,
    softcap: bool,
) -> tuple[Tensor, Tensor]:
    return scoring_forward(hidden2d, weight, token_ids, bias, LogitMap(logit_inner, logit_outer, softcap))


@_logprobs_entropy_op.register_fake
def _logprobs_entropy_fake(hidden2d, weight, bias, token_ids, *_logit_map):
    n = hidden2d.shape[0]
    return (hidden2d.new_empty((n,), dtype=torch.float32), hidden2d.new_empty((n,), dtype=torch.float32))


def takes_three_matmul_path(inputs: SageInputs, config: LossConfig) -> bool:
    """Whether a loss call with `inputs` and `config` runs the three-matmul path (not fp16: see above)."""
    dtype = inputs.hidden.dtype
    return exact_for(config) and dtype != torch.float16 and has_fp32_output(dtype, inputs.hidden.device)


def sage_loss(inputs: SageInputs, config: LossConfig) -> SageLossOutput:
    """The SAGE loss of validated `inputs` with the fused Triton kernels (backend "triton")."""
    check_device(inputs.hidden)
    tensors = LossTensors.of(inputs)
    floats, ints, num_items = pack_config(config)
    args = (*tensors.flat(), num_items, floats, ints)
    if takes_three_matmul_path(inputs, config):
        out = torch.ops.sage_kernels.triton_sage_loss_local(*args, GradsWanted.of(tensors).flat())
        out = LocalOutputs.from_flat(out)
    else:
        out = TwoPassOutputs.from_flat(torch.ops.sage_kernels.triton_sage_loss(*args))
    metrics = out.metrics.detach()
    return SageLossOutput(
        loss=out.loss,
        logp=out.logp.detach(),
        entropy=out.entropy.detach(),
        q=out.q.detach(),
        kl=out.kl.detach(),
        ratio=out.ratio.detach(),
        metrics={name: metrics[i] for i, name in enumerate(METRIC_NAMES)},
    )


def logprobs_and_entropy(
    hidden2d: Tensor,
    weight: Tensor,
    token_ids_flat: Tensor,
    bias: Tensor | None,
    temperature: float,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """logp and entropy [N] in float32 for every row of `hidden2d` (no gradient)."""
    check_device(hidden2d)
    inner, outer, softcap = logit_map(float(temperature), float(logit_scale), logit_softcap)
    return torch.ops.sage_kernels.triton_logprobs_entropy(
        hidden2d, weight, bias, token_ids_flat, float(inner), float(outer), bool(softcap)
    )
