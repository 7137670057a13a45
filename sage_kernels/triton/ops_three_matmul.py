"""The three-matmul path as a `torch.library` operator, ``sage_kernels::triton_sage_loss_local``:
the loss, the [B, L] per-token outputs, the metrics and the gradients, formed in the forward
(`three_matmul.py`); its backward scales them by the upstream gradient in place."""

from __future__ import annotations

import torch
from torch import Tensor

from ..first_order import first_order_only
from ..metrics import COLUMNS, METRIC_NAMES, metrics_vector
from ..packing import layout_of
from ..spec import LossConfig
from .boundary import (
    GradsWanted,
    LocalOutputs,
    LossTensors,
    MaybeTensor,
    none_as_empty,
    row_order,
    unpack_config,
)
from .three_matmul import fused_loss


def local_forward(tensors: LossTensors, config: LossConfig, wanted: GradsWanted) -> LocalOutputs:
    """The three-matmul path behind the local loss operator; gradients None where not `wanted`."""
    layout = layout_of(tensors)
    out = fused_loss(tensors.for_kernels(), config, row_order(layout.to_rows(tensors.mask)), wanted)
    return LocalOutputs(
        loss=out.stage.row_stats[:, COLUMNS.loss].sum(),
        logp=layout.to_grid(out.logp),
        entropy=layout.to_grid(out.entropy),
        q=out.stage.q,
        kl=out.stage.kl,
        ratio=out.stage.ratio,
        metrics=metrics_vector(out.stage.row_stats, tensors.mask),
        grad_hidden=out.grad_hidden,
        grad_weight=out.grad_weight,
        grad_bias=out.grad_bias,
    )


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
    sampling_logp: MaybeTensor,
    cells: MaybeTensor,
    num_items: MaybeTensor,
    floats: list[float],
    ints: list[int],
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    tensors = LossTensors(
        hidden, weight, bias, token_ids, mask, advantages, old_logp, ref_logp, is_weights, log_q, sampling_logp, cells
    )
    out = local_forward(tensors, unpack_config(floats, ints, num_items), GradsWanted.from_flat(needs))
    empty_if_none = dict(
        grad_hidden=none_as_empty(out.grad_hidden, hidden),
        grad_weight=none_as_empty(out.grad_weight, hidden),
        grad_bias=none_as_empty(out.grad_bias, hidden),
    )
    return out._replace(**empty_if_none).flat()


@_local_loss_op.register_fake
def _local_loss_fake(*args):
    tensors = LossTensors.from_flat(args[: len(LossTensors._fields)])
    wanted = GradsWanted.from_flat(args[-1])
    B, L = tensors.mask.shape
    hidden = tensors.hidden
    f32 = dict(dtype=torch.float32, device=hidden.device)
    per_token = [hidden.new_empty((B, L), **f32) for _ in range(5)]
    grads = [
        torch.empty_like(t) if need and t is not None else hidden.new_empty((0,))
        for t, need in zip((hidden, tensors.weight, tensors.bias), wanted)
    ]
    return (hidden.new_empty((), **f32), *per_token, hidden.new_empty((len(METRIC_NAMES),), **f32), *grads)


def _local_setup_context(ctx, inputs, output):
    out = LocalOutputs.from_flat(output)
    ctx.save_for_backward(out.grad_hidden, out.grad_weight, out.grad_bias)
    ctx.n_inputs = len(inputs)
    ctx.used = False
    # only the loss takes a gradient: autograd would otherwise fill every other output's gradient
    # with zeros, the returned gradients' included ([V, D] and [N, D] per backward)
    ctx.set_materialize_grads(False)


@first_order_only("triton backend")
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
    return (*grads,) + (None,) * (ctx.n_inputs - len(grads))


_local_loss_op.register_autograd(_local_backward, setup_context=_local_setup_context)
