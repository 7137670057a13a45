"""verl's fused-kernel interface, ours: log-probs and entropies over the LM head without [N, V] logits.

`linear_cross_entropy(hidden, weight, labels, temperature, reduction, dist_process_group)`:
verl's fused-kernel interface (``verl.utils.kernel.linear_cross_entropy``): per-token log-probs
and entropies, both differentiable, without [N, V] logits in the forward. With a
`dist_process_group` the LM head is vocabulary-parallel (`sage_kernels.vocab_parallel`: each
rank's `weight` is its contiguous V/tp shard, `labels` global ids) and, as in verl's kernel, the
hidden gradient is this rank's share, summed by the caller (Megatron's sequence-parallel gather
does it in its backward). `patch_verl_fused_kernel()` puts it where verl 0.9.1 looks it up, so
it also runs where verl's Triton kernel cannot (CPU):
  - patched: the attribute of ``verl.utils.kernel.linear_cross_entropy``, which the
    transformers forwards with ``use_fused_kernels=True`` and the triton backend import at each
    call (``verl.models.transformers.dense_common``, ``qwen2_vl``, ``qwen3_vl``, ``qwen3_5``,
    ``glm4v``), and the names bound at import by the Megatron forwards
    ``verl.models.mcore.model_forward_fused`` (the fused GPTModel forward, with
    ``get_tensor_model_parallel_group()``) and ``verl.models.mcore.model_forward_1f1b_overlap``:
    rebound where those modules are already loaded, and bound to ours by their own import when
    they load after the patch;
  - not patched, because they never call it: the transformers forwards' torch backend
    (``impl_backend=torch``, verl's ``FusedLinearForPPO``) and every path without fused kernels
    (logits materialised; Megatron's ``vocab_parallel_log_probs_from_logits``).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ..function import logprobs_and_entropy
from ..reference import reference_logprobs_and_entropy
from ..vocab_parallel import sharded_logprobs_and_entropy

#: rows per recomputed block in the backward of `linear_cross_entropy` (a [rows, V] float32 workspace).
BACKWARD_BLOCK_ROWS = 1024


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward: the fused sweep (no logits kept). Backward: recompute the logits block by block
    and differentiate the reference maths, so memory stays O(block * V)."""

    @staticmethod
    def forward(ctx, hidden2d, weight, labels, temperature, backend):
        logp, entropy = logprobs_and_entropy(
            hidden2d.detach(), weight.detach(), labels, temperature=temperature, backend=backend
        )
        ctx.save_for_backward(hidden2d, weight, labels)
        ctx.temperature = temperature
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden2d, weight, labels = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_logp = torch.zeros_like(labels, dtype=torch.float32) if grad_logp is None else grad_logp.float()
        grad_entropy = torch.zeros_like(grad_logp) if grad_entropy is None else grad_entropy.float()
        if torch.is_grad_enabled():  # create_graph=True: a gradient that is itself differentiable
            return (*_differentiable_grads(ctx, grad_logp, grad_entropy), None, None, None)
        grad_hidden = torch.zeros_like(hidden2d, dtype=torch.float32) if need_hidden else None
        weight32 = weight.detach().float().requires_grad_(need_weight)
        for start in range(0, labels.shape[0], BACKWARD_BLOCK_ROWS):
            rows = slice(start, start + BACKWARD_BLOCK_ROWS)
            with torch.enable_grad():
                block = hidden2d[rows].detach().float().requires_grad_(need_hidden)
                logp, entropy = reference_logprobs_and_entropy(
                    block, weight32, labels[rows], temperature=ctx.temperature
                )
                torch.autograd.backward((logp, entropy), (grad_logp[rows], grad_entropy[rows]))
            if need_hidden:
                grad_hidden[rows] = block.grad
        return (
            None if grad_hidden is None else grad_hidden.to(hidden2d.dtype),
            weight32.grad.to(weight.dtype) if need_weight else None,
            None,
            None,
            None,
        )


def _differentiable_grads(ctx, grad_logp, grad_entropy):
    """`_LinearCrossEntropy`'s backward under ``create_graph=True``: autograd through the reference
    maths with its graph kept (all [N, V] logits at once, as a second derivative through them needs)."""
    hidden2d, weight, labels = ctx.saved_tensors
    logp, entropy = reference_logprobs_and_entropy(
        hidden2d.float(), weight.float(), labels, temperature=ctx.temperature
    )
    needed = [t for t, need in zip((hidden2d, weight), ctx.needs_input_grad) if need]
    grads = iter(torch.autograd.grad((logp, entropy), needed, (grad_logp, grad_entropy), create_graph=True))
    return tuple(next(grads).to(t.dtype) if need else None for t, need in zip((hidden2d, weight), ctx.needs_input_grad))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group=None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's fused kernel interface: log pi(labels) and the entropy of softmax(hidden @ weight.T / T).

    hidden: [..., D]; weight: [V, D], or this rank's [V/tp, D] shard with `dist_process_group`
    (rank r holding global ids [r V/tp, (r + 1) V/tp)); labels: [...] global token ids in [0, V).
    Returns two float32 tensors shaped like `labels`, both differentiable with respect to `hidden`
    and `weight`; with `dist_process_group` they are the whole vocabulary's on every rank, the
    weight shard's gradient is exact and the hidden gradient is this rank's share, which the caller
    sums over the group (verl's convention). Only ``reduction="none"`` (what verl's models use).
    """
    if reduction != "none":
        raise ValueError(f"reduction must be 'none', got {reduction!r}")
    if dist_process_group is not None:
        if not isinstance(dist_process_group, dist.ProcessGroup):
            raise ValueError(f"dist_process_group must be a torch.distributed ProcessGroup, got {dist_process_group!r}")
        return sharded_logprobs_and_entropy(
            hidden, weight, labels, group=dist_process_group, temperature=float(temperature), backend=backend
        )
    lead = labels.shape
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    logp, entropy = _LinearCrossEntropy.apply(hidden2d, weight, labels.reshape(-1).long(), float(temperature), backend)
    return logp.view(lead), entropy.view(lead)


def patch_verl_fused_kernel() -> list[str]:
    """Make verl's fused-kernel forwards call `linear_cross_entropy`; returns the modules patched.

    Replaces the attribute of ``verl.utils.kernel.linear_cross_entropy`` (read at each call by the
    transformers forwards) and the copy of verl's function in every loaded ``verl.*`` module that
    imported it by name at load (the Megatron forwards); modules loaded later import ours. The
    module docstring lists the paths this reaches and those it does not. Call it in every worker
    process before training.
    """
    import verl.utils.kernel.linear_cross_entropy as verl_kernel

    original = verl_kernel.linear_cross_entropy
    if original is linear_cross_entropy:  # patched before: every module verl loads now imports ours
        return []
    patched = [
        name
        for name, module in list(sys.modules.items())
        if name.startswith("verl.") and getattr(module, "linear_cross_entropy", None) is original
    ]
    for name in patched:
        sys.modules[name].linear_cross_entropy = linear_cross_entropy
    return patched
