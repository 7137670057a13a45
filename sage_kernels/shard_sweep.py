"""One shard of the LM head's vocabulary: lse, logp and entropy of each row over the shard, differentiable.

A vocabulary-parallel head (`vocab_parallel.py`) combines these three per-shard values across the
ranks, so the loss reaches each shard through all three, with gradients d_lse, d_logp and d_H per
row. On the shard's logits z (target y, p = softmax(z)) that is

    dz_v = d_logp (1[v = y] - p_v) + d_lse p_v - d_H p_v (log p_v + H)
         = [the backends' sweep gradient with g = d_logp - d_lse, c = d_H] + d_lse 1[v = y],

so the fused backends' own backward sweep does the [rows x V] work and the last term, one row of
W per token, is added here (`_add_target_term`). Each backend's ``shard_stats`` (`backends.Backend`)
is this Function over its own sweep (cpu.py, triton/shard_sweep.py); the reference backend's is
plain autograd through the materialised logits instead, which keeps it an independent check of that
identity.
"""

from __future__ import annotations

import torch

from .first_order import SHARDED_SECOND_ORDER, first_order_only


class FusedShardSweep(torch.autograd.Function):
    """Forward: a fused backend's sweep. Backward: its backward sweep with g = d_logp - d_lse and
    c = d_H, plus the target-row term d_lse 1[v = y] (the module docstring derives it)."""

    @staticmethod
    def forward(ctx, hidden2d, weight, bias, token_ids, temperature, sweep_type):
        """`sweep_type(hidden2d, weight, bias, token_ids, temperature)` has ``forward()`` ->
        (lse, logp, entropy) and ``backward(g, c, need_hidden, need_weight, need_bias)`` -> the
        three gradients (None where not needed)."""
        sweep = sweep_type(hidden2d, weight, bias, token_ids, temperature)  # forward runs without grad
        ctx.sweep = sweep
        ctx.save_for_backward(hidden2d, weight, bias, token_ids)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return sweep.forward()

    @staticmethod
    @first_order_only("vocabulary-parallel head", SHARDED_SECOND_ORDER)
    def backward(ctx, d_lse, d_logp, d_entropy):
        hidden2d, weight, bias, token_ids = ctx.saved_tensors
        sweep, ctx.sweep = ctx.sweep, None
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        need_bias = bias is not None and ctx.needs_input_grad[2]
        zeros = torch.zeros(hidden2d.shape[0], dtype=torch.float32, device=hidden2d.device)
        d_logp, d_entropy = (zeros if d is None else d.float().contiguous() for d in (d_logp, d_entropy))
        if d_lse is None:
            # lse unused (verl's linear_cross_entropy returns logp and H only): the target term's
            # coefficient is identically zero, and adding it would cost an fp32 copy of each gradient
            grads = sweep.backward(d_logp, d_entropy, need_hidden, need_weight, need_bias)
        else:
            d_lse = d_lse.float().contiguous()
            grads = sweep.backward(d_logp - d_lse, d_entropy, need_hidden, need_weight, need_bias)
            grads = _add_target_term(grads, d_lse / ctx.temperature, hidden2d, weight, token_ids)
        out = tuple(None if g is None else g.to(like.dtype) for g, like in zip(grads, (hidden2d, weight, bias)))
        return (*out, None, None, None)


def _add_target_term(grads, coef, hidden2d, weight, token_ids):
    """`grads` (hidden, weight, bias; any may be None) plus the gradients of sum_t coef_t z_t[y_t]
    (without the temperature, which `coef` carries), in float32."""
    grad_hidden, grad_weight, grad_bias = (None if g is None else g.float() for g in grads)
    if grad_hidden is not None:
        grad_hidden = grad_hidden + coef[:, None] * weight.detach().index_select(0, token_ids).float()
    if grad_weight is not None:
        grad_weight = grad_weight.index_add(0, token_ids, coef[:, None] * hidden2d.detach().float())
    if grad_bias is not None:
        grad_bias = grad_bias.index_add(0, token_ids, coef)
    return grad_hidden, grad_weight, grad_bias
