"""The public entry points: `fused_linear_sage_loss` and `logprobs_and_entropy`.

They validate once (`inputs.validate_inputs`), pick a backend from the table (`backends.py`) and
hand it canonical inputs. Each backend keeps its own autograd Function beside its kernels.
"""

from __future__ import annotations

import functools
import sys

import torch

from .backends import backend_named, device_of, resolve_backend
from .inputs import SageLossOutput, validate_inputs, validate_scoring_inputs
from .packing import check_scoring_layout, rows_output, validate_packed_inputs
from .spec import OPTION_NAMES, LossConfig, resolve_config


def _full_tensor(value):
    """A DTensor gathered whole, once (``full_tensor``); anything else as it is.

    The gradient it sends back to its shards is the mean over its mesh of the ranks' gradients: what
    FSDP2 and DDP do with data-parallel gradients, and each rank's own when the ranks hold the same
    data (tensor parallelism). A shard is never read as if it were the whole tensor."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists
    if dtensor is None or not isinstance(value, dtensor.DTensor):
        return value
    return value.full_tensor(grad_placements=[dtensor.Partial("avg")] * value.device_mesh.ndim)


def _gathers_dtensors(entry_point):
    """`entry_point` with every DTensor argument (FSDP2's sharded LM head, a tensor-parallel
    hidden) replaced by its whole tensor (`_full_tensor`) before validation."""

    @functools.wraps(entry_point)
    def call(*args, **kwargs):
        return entry_point(*map(_full_tensor, args), **{k: _full_tensor(v) for k, v in kwargs.items()})

    return call


@_gathers_dtensors
def fused_linear_sage_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    log_q: torch.Tensor | None = None,
    sampling_logp: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    config: LossConfig | None = None,
    backend: str = "auto",
    **options,
) -> SageLossOutput:
    """The SAGE loss (``docs/loss.md``) from hidden states and the LM head.

    Args:
        hidden: [B, L, D] or [B*L, D] last hidden states at the positions that predict each
            completion token (float32, bfloat16 or float16; float64 for the reference).
        weight: [V, D] LM head, same dtype. With ``requires_grad=False`` no weight gradient
            is computed.
        token_ids: [B, L] sampled tokens, in [0, V) where `mask` is set.
        mask: [B, L] completion mask (bool or 0/1).
        advantages: [B] or [B, L] advantages.
        bias: [V] LM-head bias or None.
        old_logp: [B, L] behaviour-policy log-probs; None means on-policy (ratio 1 with gradient).
        ref_logp: [B, L] reference log-probs; required when beta != 0.
        is_weights: [B, L] rollout importance-sampling corrections, multiplying the PG term.
        log_q: [B, L] external guide; overrides ``config.guide``.
        sampling_logp: [B, L] the sampler's log-probs (e.g. vLLM's), read only by the off-policy
            mask (``off_policy_mask_threshold``), which otherwise uses `old_logp`; NaN marks a
            token the sampler could not score.
        cu_seqlens: [S + 1] int32/int64 boundaries of S packed sequences (flash-attention's varlen
            layout, `packing.py`): then `hidden` is [N, D] or [1, N, D], `token_ids`, `mask` and
            every per-token input [N] or [1, N], `advantages` [S] per sequence or [N] per token,
            and the per-token outputs are shaped like `token_ids`; each option means what it means
            for the padded call on the same sequences (luspo_include_padding is refused).
        config: a `LossConfig`; keyword `options` override its fields ({options}).
        backend: "auto", "reference", "cpu" or "triton".

    Returns:
        `SageLossOutput`: ``.loss`` (scalar, differentiable), detached [B, L] ``.logp``,
        ``.entropy``, ``.q``, ``.kl``, ``.ratio`` and ``.metrics``.
    """
    config = resolve_config(config, options)
    chosen = backend_named(resolve_backend(backend, device_of(hidden)))
    arguments = dict(
        bias=bias,
        old_logp=old_logp,
        ref_logp=ref_logp,
        is_weights=is_weights,
        log_q=log_q,
        sampling_logp=sampling_logp,
        config=config,
        allowed_dtypes=chosen.DTYPES,
    )
    if cu_seqlens is None:
        inputs = validate_inputs(hidden, weight, token_ids, mask, advantages, **arguments)
    else:
        inputs = validate_packed_inputs(hidden, weight, token_ids, mask, advantages, cu_seqlens=cu_seqlens, **arguments)
    out = chosen.sage_loss(inputs, config)
    check_logits_finite(out.logp, out.entropy, inputs.loss_mask, config)
    return out if cu_seqlens is None else rows_output(out, inputs, tuple(token_ids.shape))


fused_linear_sage_loss.__doc__ = fused_linear_sage_loss.__doc__.replace("{options}", ", ".join(OPTION_NAMES))


@_gathers_dtensors
def logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each token and the entropy (nats) of its next-token distribution, in float32.

    For reference-model and behaviour-policy scoring: no gradient, no [N, V] logits on the
    fast backends. `hidden` is [*S, D] and `token_ids` is [*S] (S = (B, L) or (N,)); the
    outputs have shape S. The logits are those of `LossConfig` with these `temperature`,
    `logit_scale` and `logit_softcap`. `cu_seqlens` (packed sequences, as in
    `fused_linear_sage_loss`) is checked against `token_ids` [N] or [1, N]; each token's values do
    not depend on its sequence.
    """
    chosen = backend_named(resolve_backend(backend, device_of(hidden)))
    hidden2d, ids, lead = validate_scoring_inputs(
        hidden,
        weight,
        token_ids,
        bias=bias,
        temperature=temperature,
        logit_scale=logit_scale,
        logit_softcap=logit_softcap,
        allowed_dtypes=chosen.DTYPES,
    )
    if cu_seqlens is not None:
        check_scoring_layout(token_ids, cu_seqlens, hidden.device)
    with torch.no_grad():
        logp, entropy = chosen.logprobs_and_entropy(
            hidden2d, weight, ids, bias, temperature, logit_scale, logit_softcap
        )
    check_logits_finite(
        logp,
        entropy,
        None,
        LossConfig(beta=0.0, temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap),
    )
    return logp.view(lead), entropy.view(lead)


def check_logits_finite(
    logp: torch.Tensor, entropy: torch.Tensor, where: torch.Tensor | None, config: LossConfig
) -> None:
    """After a sweep: no NaN or +inf logp and a finite entropy where read (`where`; None: everywhere).
    Every input is finite by then (`inputs.validate_inputs`), so anything else means that a logit
    z = s (W h + b) / T overflowed to +inf: a ValueError naming temperature and logit_scale (on CUDA
    an asynchronous device assertion, so no host sync is added). A logp of -inf is a probability
    that rounds to 0 (a vocabulary entry masked by a bias of finfo.min over T < 1) and passes."""
    finite = (logp < torch.inf) & torch.isfinite(entropy)  # NaN < inf is False
    finite = finite if where is None else finite | ~where
    message = (
        f"temperature={config.temperature!r} and logit_scale={config.logit_scale!r} (logit_softcap="
        f"{config.logit_softcap!r}) make the logits s (W h + b) / T overflow {logp.dtype}: logp or entropy is "
        "not finite; use a larger temperature or a smaller logit_scale"
    )
    if logp.device.type == "cpu":
        if not bool(finite.all()):
            raise ValueError(message)
    else:
        torch._assert_async(finite.all(), message)
