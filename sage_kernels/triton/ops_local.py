"""The three-matmul path as a `torch.library` operator, ``sage_kernels::triton_sage_loss_local``:
the loss, the [B, L] per-token outputs, the metrics and the gradients, formed in the forward
(`three_matmul.py`); its backward scales them by the upstream gradient in place."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..spec import METRIC_NAMES, LossConfig
from . import token_stage as stage
from .boundary import N_OTHER_INPUTS, contiguous, metrics_vector, none_as_empty, row_order, unit_stride, unpack_config
from .three_matmul import fused_loss

MaybeTensor = Optional[Tensor]


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
    _, rows, count, n, identity = row_order(mask)
    old_logp, ref_logp, is_weights, log_q, advantages = contiguous(old_logp, ref_logp, is_weights, log_q, advantages)
    logp, entropy, q, kl, ratio, _, _, row_stats, grad_hidden, grad_weight, grad_bias = fused_loss(
        unit_stride(hidden),
        unit_stride(weight),
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
        metrics_vector(row_stats, mask),
        grad_hidden,
        grad_weight,
        grad_bias,
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
        unpack_config(floats, ints, num_items),
        *needs,
    )
    return out[:7] + tuple(none_as_empty(grad, hidden) for grad in out[7:])


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
    # only the loss takes a gradient: autograd would otherwise fill every other output's gradient
    # with zeros, the returned gradients' included ([V, D] and [N, D] per backward)
    ctx.set_materialize_grads(False)
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
    return (*grads,) + (None,) * (N_OTHER_INPUTS + 1)


_local_loss_op.register_autograd(_local_backward, setup_context=_local_setup_context)
