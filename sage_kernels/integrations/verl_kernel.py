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

from ..backends import backend_named, device_of, resolve_backend
from ..function import check_logits_finite
from ..inputs import validate_scoring_inputs
from ..reference import reference_logprobs_and_entropy
from ..spec import LossConfig
from ..vocab_parallel import sharded_logprobs_and_entropy


class _LinearCrossEntropy(torch.autograd.Function):
    """The backend's shard sweep over the whole vocabulary (one shard: `backends.Backend.shard_stats`),
    whose gradient is itself differentiable. First order: the sweep's fused backward, its graph kept
    inside this Function (no logits kept). Under ``create_graph=True``: autograd through the
    reference maths instead, since the fused backward's gradients carry no graph (`first_order.py`)."""

    @staticmethod
    def forward(ctx, hidden2d, weight, labels, temperature, backend, keep_graph):
        # needs_input_grad is set under no_grad too: `keep_graph` (the caller's grad mode) decides
        leaves = [
            t.detach().requires_grad_(keep_graph and need) for t, need in zip((hidden2d, weight), ctx.needs_input_grad)
        ]
        with torch.set_grad_enabled(keep_graph):
            _, logp, entropy = backend.shard_stats(*leaves, None, labels, temperature)
        ctx.sweep = leaves, logp, entropy
        ctx.save_for_backward(hidden2d, weight, labels)
        ctx.temperature = temperature
        return logp.detach(), entropy.detach()

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        sweep, ctx.sweep = ctx.sweep, None  # its graph runs once: a second backward (retain_graph) recomputes
        create_graph = torch.is_grad_enabled()  # create_graph=True: a gradient that is itself differentiable
        if create_graph or sweep is None:
            with torch.enable_grad():
                grads = _reference_grads(ctx, grad_logp.float(), grad_entropy.float(), create_graph)
            return (*grads, None, None, None, None)
        leaves, logp, entropy = sweep
        needed = [leaf for leaf in leaves if leaf.requires_grad]
        grads = iter(torch.autograd.grad((logp, entropy), needed, (grad_logp, grad_entropy)))
        return (*(next(grads) if leaf.requires_grad else None for leaf in leaves), None, None, None, None)


def _reference_grads(ctx, grad_logp, grad_entropy, create_graph: bool):
    """`_LinearCrossEntropy`'s backward by autograd through the reference maths (all [N, V] logits at
    once): under ``create_graph=True`` with its graph kept, as a second derivative needs, and for a
    second backward through a retained graph, whose sweep has run its backward already."""
    hidden2d, weight, labels = ctx.saved_tensors
    logp, entropy = reference_logprobs_and_entropy(
        hidden2d.float(), weight.float(), labels, temperature=ctx.temperature
    )
    needed = [t for t, need in zip((hidden2d, weight), ctx.needs_input_grad) if need]
    grads = iter(torch.autograd.grad((logp, entropy), needed, (grad_logp, grad_entropy), create_graph=create_graph))
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
    chosen = backend_named(resolve_backend(backend, device_of(hidden)))
    lead = labels.shape
    hidden2d, ids, _ = validate_scoring_inputs(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1).long(),
        temperature=temperature,
        allowed_dtypes=chosen.DTYPES,
    )
    temperature = float(temperature)
    logp, entropy = _LinearCrossEntropy.apply(hidden2d, weight, ids, temperature, chosen, torch.is_grad_enabled())
    check_logits_finite(logp, entropy, None, LossConfig(beta=0.0, temperature=temperature))
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
