"""A vocabulary-parallel LM head: each rank of a process group holds V/tp rows of W (and of the bias).

Megatron's layout: contiguous equal shards, rank r owning global token ids [r V_r, (r + 1) V_r);
`hidden`, the token ids, the mask and every per-token input are the same on every rank, and so is
the loss each rank computes. No rank builds [N, V] logits or gathers W.

Forward. Each rank sweeps its shard with the fused kernels of its backend (`shard_sweep`), giving
per row lse_r, H_r and the logit z_r of a local target (the true one on its owner shard). One
all-gather of those three [n] vectors, then, with w_r = exp(lse_r - lse) the shard's share of the
probability mass:

    lse  = logsumexp_r lse_r
    H    = sum_r w_r (H_r - log w_r)      the entropy of a mixture of the shards' softmaxes
    logp = z_owner - lse

and `reference.token_stage` on the global logp and H gives the loss, the same on every rank.

Backward. Each rank differentiates its own replicated loss through its own shard only: in the
gathered values its own entries keep their graph and the others' are constants. That is the exact
gradient for its weight and bias shards (nothing to reduce: summing the replicated loss's gradients
over ranks would multiply them by tp), and this shard's share of the hidden gradient, which the
loss sums over the group with one all-reduce (`reduce_hidden_grad`; Megatron's
copy-to-tensor-parallel-region). Callers whose own autograd already sums it (a sequence-parallel
gather, whose backward is a reduce-scatter) pass ``reduce_hidden_grad=False``; the differentiable
`sharded_logprobs_and_entropy` always leaves it partial, as verl's kernel does.

Cost: g = dloss/dlogp and c = dloss/dH are known only after the combine, so the backward
recomputes the shard's logits (the two-pass pattern: 4 N D V/tp multiply-adds per rank in all, not
the unsharded fast paths' 3) and the masked positions are compacted away first (one host read of
their count). Collectives per call: one all-gather of the shard sizes (the layout check), one of [3, n] float32,
and in the backward one all-reduce of [n, D] when the hidden gradient is summed. Every rank of the
group must make the same calls with the same shapes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .backends import Backend, backend_named, device_of, resolve_backend
from .first_order import SHARDED_SECOND_ORDER, first_order_only
from .function import check_logits_finite
from .inputs import SageLossOutput, validate_inputs, validate_scoring_inputs
from .reference import token_stage
from .spec import LossConfig, resolve_config


def vocab_parallel_sage_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    group,
    bias: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    log_q: torch.Tensor | None = None,
    sampling_logp: torch.Tensor | None = None,
    config: LossConfig | None = None,
    backend: str = "auto",
    reduce_hidden_grad: bool = True,
    **options,
) -> SageLossOutput:
    """`fused_linear_sage_loss` with the LM head sharded over the vocabulary across `group`.

    `weight` [V/tp, D] and `bias` [V/tp] are this rank's shard (rank r of `group` holds global ids
    [r V/tp, (r + 1) V/tp), every shard the same size); `token_ids` are global ids in [0, V) and,
    like every other argument, the same on every rank. Returns the same `SageLossOutput` on every
    rank. Gradients: this rank's `weight` and `bias` shards get their exact gradient; `hidden`
    gets the full gradient, summed over `group` in the backward, or with
    ``reduce_hidden_grad=False`` only this shard's share (for callers whose autograd sums it).
    """
    config = resolve_config(config, options)
    if config.logit_scale != 1.0 or config.logit_softcap is not None:
        # the shard sweeps and the target-row term are written for z = (W h + b) / T only
        raise ValueError(
            "logit_scale and logit_softcap must be 1.0 and None for a vocabulary-parallel head (not supported yet), "
            f"got {config.logit_scale!r} and {config.logit_softcap!r}"
        )
    chosen = backend_named(resolve_backend(backend, device_of(hidden)))
    vocab_start, vocab = _shard_layout(weight, group)
    inputs = validate_inputs(
        hidden,
        weight,
        _local_ids(token_ids, vocab_start, weight.shape[0]),
        mask,
        advantages,
        bias=bias,
        old_logp=old_logp,
        ref_logp=ref_logp,
        is_weights=is_weights,
        log_q=log_q,
        sampling_logp=sampling_logp,
        config=config,
        allowed_dtypes=chosen.DTYPES,
    )
    active = inputs.loss_mask
    _check_global_ids(token_ids, active, vocab)
    B, L = inputs.shape
    rows = active.reshape(-1).nonzero().squeeze(1)
    hidden2d = _SumGradOverGroup.apply(inputs.hidden, group) if reduce_hidden_grad else inputs.hidden
    logp_rows, entropy_rows = _combined_stats(
        hidden2d.index_select(0, rows),
        weight,
        bias,
        token_ids.reshape(-1).long().index_select(0, rows),
        inputs.token_ids.reshape(-1).index_select(0, rows),
        config.temperature,
        group,
        chosen,
    )
    zeros = logp_rows.new_zeros(B * L)
    logp = zeros.index_copy(0, rows, logp_rows).view(B, L)
    entropy = zeros.index_copy(0, rows, entropy_rows).view(B, L)
    check_logits_finite(logp, entropy, active, config)
    loss, per_token = token_stage(logp, entropy, inputs, config)
    return SageLossOutput(
        loss=loss,
        logp=logp.detach(),
        entropy=entropy.detach(),
        q=per_token["q"],
        kl=per_token["kl"],
        ratio=per_token["ratio"],
        metrics=per_token["metrics"],
    )


def vocab_parallel_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    group,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprobs_and_entropy` with the LM head sharded over the vocabulary across `group` (no gradient).

    `weight`/`bias` are this rank's shard, `token_ids` global ids, as in `vocab_parallel_sage_loss`;
    every rank gets the same log-probs and entropies, shaped like `token_ids`.
    """
    with torch.no_grad():
        return sharded_logprobs_and_entropy(
            hidden, weight, token_ids, group=group, bias=bias, temperature=temperature, backend=backend
        )


def sharded_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    group,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`vocab_parallel_logprobs_and_entropy`, differentiable: the weight and bias shards get their
    exact gradient and `hidden` this shard's share of its gradient, to be summed over `group` by the
    caller (verl's ``linear_cross_entropy(dist_process_group=...)`` convention)."""
    chosen = backend_named(resolve_backend(backend, device_of(hidden)))
    vocab_start, vocab = _shard_layout(weight, group)
    local = _local_ids(token_ids, vocab_start, weight.shape[0])
    hidden2d, local_flat, lead = validate_scoring_inputs(
        hidden,
        weight,
        local,
        bias=bias,
        temperature=temperature,
        allowed_dtypes=chosen.DTYPES,
    )
    ids = token_ids.reshape(-1).long()
    _check_global_ids(ids, torch.ones_like(ids, dtype=torch.bool), vocab)
    logp, entropy = _combined_stats(hidden2d, weight, bias, ids, local_flat, temperature, group, chosen)
    check_logits_finite(logp, entropy, None, LossConfig(beta=0.0, temperature=temperature))
    return logp.view(lead), entropy.view(lead)


def _combined_stats(hidden2d, weight, bias, token_ids, local_ids, temperature, group, backend: Backend):
    """Global (logp, entropy) [n] of the rows of `hidden2d` from every rank's shard (module docstring)."""
    lse_r, logp_r, entropy_r = backend.shard_stats(hidden2d, weight, bias, local_ids, temperature)
    mine = torch.stack((lse_r, logp_r + lse_r, entropy_r))  # this shard's lse, local target logit, H
    lse_r, target_logit, entropy_r = _all_gather_own_graph(mine, group).unbind(1)  # each [tp, n]
    lse = torch.logsumexp(lse_r, 0)
    log_share = lse_r - lse
    entropy = (log_share.exp() * (entropy_r - log_share)).sum(0)
    owner = (token_ids // weight.shape[0])[None]
    logp = target_logit.gather(0, owner).squeeze(0) - lse
    return logp, entropy


def _all_gather_own_graph(x: torch.Tensor, group) -> torch.Tensor:
    """[tp, *x.shape]: every rank's `x`; this rank's entry keeps its graph, the others are constants
    (each rank differentiates the same replicated loss through its own shard only)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.detach().contiguous(), group=group)
    parts[dist.get_rank(group)] = _OwnShardOnly.apply(x)
    return torch.stack(parts)


class _OwnShardOnly(torch.autograd.Function):
    """Identity on this rank's gathered statistics, first order only: with the other ranks' as
    constants the gradient is exact, its derivative is not (create_graph=True raises)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    @first_order_only("vocabulary-parallel head", SHARDED_SECOND_ORDER)
    def backward(ctx, grad):
        return (grad,)


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over `group` (each rank's is its shard's share)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    @first_order_only("vocabulary-parallel head", SHARDED_SECOND_ORDER)
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _shard_layout(weight, group) -> tuple[int, int]:
    """(this rank's first global token id, the global vocabulary size); every rank's shard must have
    as many rows (a collective: every rank of `group` must call it)."""
    if not (dist.is_available() and dist.is_initialized() and isinstance(group, dist.ProcessGroup)):
        raise ValueError(
            "group must be a torch.distributed process group (torch.distributed initialised; "
            f"dist.group.WORLD for every rank), got {group!r}"
        )
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be this rank's [V/tp, D] shard of the LM head, got {_describe(weight)}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    size = torch.tensor(weight.shape, dtype=torch.int64, device=weight.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    shapes = [tuple(s.tolist()) for s in sizes]
    if len(set(shapes)) != 1:
        raise ValueError(
            f"weight must be an equal shard [V/tp, D] on every rank of group (contiguous equal shards, "
            f"Megatron's layout); the ranks' shapes are {shapes}"
        )
    rows = weight.shape[0]
    return rank * rows, world * rows


def _describe(value) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(type(value))


def _local_ids(token_ids, vocab_start: int, shard_rows: int):
    """Global ids -> this shard's ids (0 where another shard owns the token); non-tensors and
    non-integer tensors pass through for the validation to name."""
    if not isinstance(token_ids, torch.Tensor) or token_ids.is_floating_point() or token_ids.dtype == torch.bool:
        return token_ids
    local = token_ids.long() - vocab_start
    return torch.where((local >= 0) & (local < shard_rows), local, 0)


def _check_global_ids(token_ids: torch.Tensor, active: torch.Tensor, vocab: int) -> None:
    """token ids in [0, V) at the `active` positions, V the global vocabulary."""
    bad = ((token_ids < 0) | (token_ids >= vocab)).reshape(active.shape) & active
    if token_ids.device.type == "cpu":
        if bool(bad.any()):
            found = int(token_ids.reshape(active.shape)[bad][0])
            raise ValueError(f"token_ids must be global ids in [0, V={vocab}) where they are read; found {found}")
    else:
        torch._assert_async(~bad.any(), f"token_ids must be global ids in [0, V={vocab}) where they are read")
