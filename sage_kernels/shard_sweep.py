"""One shard of the LM head's vocabulary: lse, logp and entropy of each row over the shard, differentiable.

A vocabulary-parallel head (`vocab_parallel.py`) combines these three per-shard values across the
ranks, so the loss reaches each shard through all three, with gradients d_lse, d_logp and d_H per
row. On the shard's logits z (target y, p = softmax(z)) that is

    dz_v = d_logp (1[v = y] - p_v) + d_lse p_v - d_H p_v (log p_v + H)
         = [the backends' sweep gradient with g = d_logp - d_lse, c = d_H] + d_lse 1[v = y],

so the fused backends' own backward sweep does the [rows x V] work and the last term, one row of
W per token, is added here (`_add_target_term`). The reference backend is plain autograd through
the materialised logits instead, which keeps it an independent check of that identity.
"""

from __future__ import annotations

import torch

from .first_order import SHARDED_SECOND_ORDER, first_order_only
from .reference import logits_of, reference_logprobs_and_entropy
from .spec import logit_map


def shard_stats(hidden2d, weight, bias, token_ids, temperature: float, backend: str):
    """(lse, logp, entropy) [n] of each row of `hidden2d` [n, D] over this shard's `weight` [V_r, D].

    `token_ids` [n] are local ids in [0, V_r). Differentiable in `hidden2d`, `weight` and `bias`;
    float64 for the reference backend on float64 inputs, float32 otherwise. `backend` is a concrete
    name ("reference", "cpu" or "triton").
    """
    if backend == "reference":
        dtype = torch.float64 if hidden2d.dtype == torch.float64 else torch.float32
        logp, entropy = reference_logprobs_and_entropy(
            hidden2d, weight, token_ids, bias=bias, temperature=temperature, dtype=dtype
        )
        lse = torch.logsumexp(logits_of(hidden2d, weight, bias, temperature, dtype), -1)
        return lse, logp, entropy
    sweep_type = _CpuShardSweep if backend == "cpu" else _TritonShardSweep
    return _FusedShardSweep.apply(hidden2d, weight, bias, token_ids, float(temperature), sweep_type)


class _CpuShardSweep:
    """The cpu backend's block loop (`cpu._Sweep`) over every row, forward and backward."""

    def __init__(self, hidden2d, weight, bias, token_ids, temperature):
        from . import cpu

        n = hidden2d.shape[0]
        self.sweep = cpu._Sweep(hidden2d, weight, bias, token_ids, None, logit_map(temperature), cpu._ops_for(None), n)

    def forward(self):
        for block in self.sweep.blocks:
            self.sweep.stats(block)
        # copies: the backward's recomputation rewrites the sweep's buffers
        return self.sweep.lse.clone(), self.sweep.logp.clone(), self.sweep.entropy.clone()

    def backward(self, g, c, need_hidden, need_weight, need_bias):
        sweep = self.sweep
        grad_hidden = torch.empty_like(sweep.hidden) if need_hidden else None
        grad_weight = torch.zeros_like(sweep.weight) if need_weight else None
        grad_bias = torch.zeros_like(sweep.bias) if need_bias else None
        for block in sweep.blocks:
            sweep.grad(block, sweep.stats(block), g, c, grad_hidden, grad_weight, grad_bias)
        return grad_hidden, grad_weight, grad_bias


class _TritonShardSweep:
    """The triton backend's two-pass sweeps (`sweep_fwd.sweep_forward`, `sweep_bwd.sweep_backward`)
    over every row."""

    def __init__(self, hidden2d, weight, bias, token_ids, temperature):
        from .triton.ops import _check_device

        _check_device(hidden2d)
        n, device = hidden2d.shape[0], hidden2d.device
        self.hidden, self.weight, self.bias = hidden2d.contiguous(), weight.contiguous(), bias
        self.token_ids, self.logits = token_ids, logit_map(temperature)
        self.rows = torch.arange(n, device=device)
        self.count = torch.full((), n, dtype=torch.int64, device=device)

    def forward(self):
        from .triton.sweep_fwd import sweep_forward

        self.stats = sweep_forward(
            self.hidden, self.weight, self.bias, self.token_ids, self.rows, self.count, self.logits
        )
        return tuple(t.clone() for t in self.stats)

    def backward(self, g, c, need_hidden, need_weight, need_bias):
        from .triton.sweep_bwd import sweep_backward

        lse, _, entropy = self.stats
        return sweep_backward(
            torch.ones((), dtype=torch.float32, device=self.hidden.device),
            self.hidden,
            self.weight,
            self.bias,
            self.token_ids,
            self.rows,
            self.count,
            lse,
            entropy,
            g,
            c,
            self.logits,
            True,
            need_weight=need_weight,
            need_bias=need_bias,
            need_hidden=need_hidden,
            rows_are_identity=True,
        )


class _FusedShardSweep(torch.autograd.Function):
    """Forward: a fused backend's sweep. Backward: its backward sweep with g = d_logp - d_lse and
    c = d_H, plus the target-row term d_lse 1[v = y] (the module docstring derives it)."""

    @staticmethod
    def forward(ctx, hidden2d, weight, bias, token_ids, temperature, sweep_type):
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
        d_lse, d_logp, d_entropy = (zeros if d is None else d.float().contiguous() for d in (d_lse, d_logp, d_entropy))
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
