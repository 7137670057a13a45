"""`FusedLinearSAGELoss`: the loss as an nn.Module with Liger-Kernel's GRPO forward signature.

Code written for ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` switches in one line:
``LigerFusedLinearGRPOLoss(**kw)`` becomes ``FusedLinearSAGELoss.from_liger(**kw)``, which takes
every constructor argument of Liger 0.8.5 with Liger's defaults (guide off), and `forward` takes
Liger's arguments and returns ``(loss, metrics)`` with Liger's metrics tuple: the mean KL when
beta != 0, then the clipped fraction. `fused_linear_grpo` is the same with the signature of
Liger's functional ``liger_fused_linear_grpo``. Add ``guide="branch"`` to turn the plain KL
anchor into SAGE's. The tuple also carries every SAGE metric by name in ``metrics.named``.

Where Liger's semantics differ from TRL's (which `LossConfig` follows), `forward` follows Liger:
- the clipped fraction is measured on the ratio before the ``delta`` cap (TRL: after); for cispo
  it counts r > epsilon_high with A > 0, for sapo and vespo it is 0; gmpo (not in Liger 0.8.5:
  `LossConfig`'s meaning, epsilon_low and epsilon_high bounding log r) counts the tokens whose
  log-space clip binds, log r < -epsilon_low with A < 0 or log r > epsilon_high with A > 0;
- ``num_items_in_batch`` given to `forward` (dapo, cispo, vespo) is the count over all processes;
  it is divided by the world size here, and when neither `forward` nor the config gives one, the
  mask sum is all-reduced, as Liger does. A ``num_items_in_batch`` in the config keeps
  `LossConfig`'s meaning (this process's divisor);
- Liger's refusals happen where Liger makes them: sequence-level ratios with cispo, sapo or
  vespo and dr_grpo without ``max_completion_length`` raise ValueError at `forward`; both
  ``ref_per_token_logps`` and ``ref_input`` given warn, and the log-probs are used;
- luspo sums the padded positions too, each row weighted by its token count, whenever the
  per-token loss varies along the row (token-level ratios, a KL term, per-token vLLM weights):
  `from_liger` sets ``luspo_include_padding`` (TRL 1.16, and `LossConfig` by default, sum the
  unmasked tokens only). Token ids and per-token inputs are then read at padded positions too.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..function import fused_linear_sage_loss, logprobs_and_entropy
from ..loss_types import LOSS_TYPES
from ..packing import per_token, read_cu_seqlens
from ..spec import LossConfig


class SageMetrics(tuple):
    """Liger's metrics tuple, plus ``.named``: the dict of `SageLossOutput.metrics`."""

    named: dict

    def __new__(cls, values, named: dict):
        out = super().__new__(cls, values)
        out.named = named
        return out


class FusedLinearSAGELoss(nn.Module):
    """The SAGE loss over an LM head. Keyword arguments are `LossConfig` fields, plus `backend`
    and `use_ref_model` (Liger's switch: False drops the KL term and ignores reference inputs)."""

    def __init__(self, *, backend: str = "auto", use_ref_model: bool = True, **options) -> None:
        super().__init__()
        self.config = LossConfig(**options)
        self.backend = backend
        self.use_ref_model = use_ref_model

    @classmethod
    def from_liger(
        cls,
        beta: float = 0.04,
        compiled: bool = True,
        use_ref_model: bool = True,
        chunk_size: int = 1,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_type: str = "dapo",
        max_completion_length: int | None = None,
        importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        temperature: float = 1.0,
        delta: float | None = None,
        use_bias_correction_kl: bool = False,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        *,
        backend: str = "auto",
        **options,
    ) -> FusedLinearSAGELoss:
        """A module computing what ``LigerFusedLinearGRPOLoss(...)`` computes with the same arguments.

        `compiled` and `chunk_size` are Liger's execution knobs (torch.compile of its loss maths,
        rows per chunk); the fused kernels tile on their own, so they select nothing here. Liger
        ignores `delta` outside PPO clipping (cispo, sapo, vespo), and so does this module (and for
        gmpo, which Liger 0.8.5 does not have). `options` are further `LossConfig` fields (guide, gamma, ...).
        """
        del compiled, chunk_size
        options = {"guide": "none", "kl": "k3", "luspo_include_padding": loss_type == "luspo", **options}
        return cls(
            backend=backend,
            use_ref_model=use_ref_model,
            **_liger_options(
                beta,
                epsilon_low,
                epsilon_high,
                loss_type,
                max_completion_length,
                importance_sampling_level,
                sapo_temperature_pos,
                sapo_temperature_neg,
                temperature,
                delta,
                use_bias_correction_kl,
                vespo_k_pos,
                vespo_lambda_pos,
                vespo_k_neg,
                vespo_lambda_neg,
            ),
            **options,
        )

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, use_ref_model={self.use_ref_model}, config={self.config}"

    def forward(
        self,
        _input: torch.Tensor,
        lin_weight: torch.Tensor,
        selected_token_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        advantages: torch.Tensor,
        bias: torch.Tensor | None = None,
        ref_per_token_logps: torch.Tensor | None = None,
        old_per_token_logps: torch.Tensor | None = None,
        ref_input: torch.Tensor | None = None,
        ref_weight: torch.Tensor | None = None,
        ref_bias: torch.Tensor | None = None,
        vllm_is_ratio: torch.Tensor | None = None,
        num_items_in_batch=None,
        *,
        cu_seqlens: torch.Tensor | None = None,
    ):
        """Liger's arguments: `_input` [B, T, D] hidden states, `lin_weight` [V, D], the sampled
        `selected_token_ids` [B, T], `attention_mask` [B, T] (completion mask), `advantages` [B].
        Reference log-probs come from `ref_per_token_logps`, or are computed from `ref_input`
        with `ref_weight` / `ref_bias` (the policy's head when `ref_weight` is None).
        `vllm_is_ratio` ([B], [B, 1] or [B, T]) multiplies the PG term. With `cu_seqlens` [S + 1]
        the batch is S packed sequences (`fused_linear_sage_loss`'s layout): `_input` [N, D] or
        [1, N, D], the per-token arguments [N] or [1, N], `advantages` and `vllm_is_ratio` [S]
        per sequence or [N] per token; luspo then needs ``luspo_include_padding=False``."""
        config = self.config
        kind = LOSS_TYPES[config.loss_type]
        # Liger refuses sequence-level ratios for the types that replace PPO's surrogate
        if config.importance_sampling == "sequence" and not kind.clipped:
            raise ValueError(
                f"Sequence-level importance sampling is not supported for loss_type="
                f"{config.loss_type!r} (as in Liger); use importance_sampling_level='token'"
            )
        if config.loss_type == "dr_grpo" and config.max_completion_length is None:
            raise ValueError("max_completion_length is required for loss_type 'dr_grpo', as in Liger")
        if self.use_ref_model:
            if ref_per_token_logps is not None and ref_input is not None:
                warnings.warn(  # Liger's words, which its tests match
                    "Both ref_per_token_logps and ref_input are provided. Using ref_per_token_logps.",
                    UserWarning,
                    stacklevel=2,
                )
        else:
            # Liger then anchors to the policy itself: the KL is 0 with zero gradient.
            ref_per_token_logps = ref_input = None
            config = config.replace(beta=0.0)
        liger_divisor = num_items_in_batch is not None or config.num_items_in_batch is None
        if kind.normaliser == "given_tokens" and liger_divisor:  # Liger's dapo normaliser
            normaliser = _liger_dapo_normaliser(attention_mask, num_items_in_batch)
            config = config.replace(num_items_in_batch=normaliser)
        if ref_per_token_logps is None and ref_input is not None and config.beta != 0:
            head = lin_weight if ref_weight is None else ref_weight
            ref_per_token_logps, _ = logprobs_and_entropy(
                ref_input.detach(),
                head.detach(),
                selected_token_ids,
                bias=None if ref_bias is None else ref_bias.detach(),
                temperature=config.temperature,
                logit_scale=config.logit_scale,
                logit_softcap=config.logit_softcap,
                backend=self.backend,
            )
        if vllm_is_ratio is not None:
            vllm_is_ratio = _weights_per_token(vllm_is_ratio, selected_token_ids, _input, cu_seqlens)
        out = fused_linear_sage_loss(
            _input,
            lin_weight,
            selected_token_ids,
            attention_mask,
            advantages,
            bias=bias,
            old_logp=old_per_token_logps,
            ref_logp=ref_per_token_logps,
            is_weights=vllm_is_ratio,
            cu_seqlens=cu_seqlens,
            config=config,
            backend=self.backend,
        )
        A = advantages.detach()
        if cu_seqlens is not None:  # checked by the loss call
            A = per_token("advantages", A, cu_seqlens, selected_token_ids.numel()).reshape(out.ratio.shape)
        elif A.dim() == 1:
            A = A[:, None]
        tokens = attention_mask.float().sum().clamp(min=1.0)  # Liger's means: 0, not NaN, without a token
        values = [(out.kl * attention_mask).sum() / tokens] if self.config.beta != 0 else []
        values.append(_liger_clip_fraction(out.ratio, A, attention_mask, config))
        return out.loss, SageMetrics(values, out.metrics)


def _weights_per_token(weights: torch.Tensor, token_ids: torch.Tensor, hidden: torch.Tensor, cu_seqlens):
    """Liger's `vllm_is_ratio` ([B], [B, 1] or [B, T]; packed: [S], [S, 1], [N] or [1, N]) shaped
    like `token_ids`."""
    if cu_seqlens is None:
        return weights.reshape(weights.shape[0], -1).expand_as(token_ids)
    read_cu_seqlens(cu_seqlens, token_ids.numel(), hidden.device)  # checked before it expands anything
    return per_token("vllm_is_ratio", weights, cu_seqlens, token_ids.numel()).reshape(token_ids.shape)


def _liger_dapo_normaliser(mask: torch.Tensor, num_items_in_batch):
    """Liger's dapo divisor: the completion-token count over all processes, per process, at least 1.

    A number stays a Python float (a device tensor made from it would be a host-to-device copy,
    and a wait, on every call); a tensor count stays a tensor on the mask's device."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    world_size = torch.distributed.get_world_size() if distributed else 1
    if num_items_in_batch is None:
        total = mask.float().sum()
        if distributed:
            torch.distributed.all_reduce(total)
    elif isinstance(num_items_in_batch, torch.Tensor):
        total = num_items_in_batch.to(device=mask.device, dtype=torch.float32)
    else:
        return max(float(num_items_in_batch) / world_size, 1.0)
    return (total / world_size).clamp(min=1.0)


def _liger_clip_fraction(ratio: torch.Tensor, A: torch.Tensor, mask: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """Fraction of unmasked tokens whose ratio (before the delta cap) is clipped in the sign of the
    advantages `A` (broadcastable to `ratio`)."""
    bounds = LOSS_TYPES[config.loss_type].bounds
    if bounds == "ratio_cap":
        clipped = (ratio > config.eps_high) & (A > 0)
    elif bounds == "log_ratio":  # GMPO's clip is on the log-ratio (reference.gmpo_ratio)
        log_ratio = ratio.log()
        clipped = ((log_ratio < -config.eps_low) & (A < 0)) | ((log_ratio > config.eps_high) & (A > 0))
    elif bounds == "ratio":
        clipped = ((ratio < 1.0 - config.eps_low) & (A < 0)) | ((ratio > 1.0 + config.eps_high) & (A > 0))
    else:
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
    m = mask.float()
    return (clipped.float() * m).sum() / m.sum().clamp(min=1.0)


def _liger_options(
    beta,
    epsilon_low,
    epsilon_high,
    loss_type,
    max_completion_length,
    importance_sampling_level,
    sapo_temperature_pos,
    sapo_temperature_neg,
    temperature,
    delta,
    use_bias_correction_kl,
    vespo_k_pos,
    vespo_lambda_pos,
    vespo_k_neg,
    vespo_lambda_neg,
) -> dict:
    """Liger's GRPO arguments as `LossConfig` fields. The sapo and vespo parameters (and delta) are
    kept only for the loss types that read them, as Liger reads them only there."""
    options = dict(
        beta=beta,
        eps_low=epsilon_low,
        eps_high=epsilon_high,
        loss_type=loss_type,
        max_completion_length=max_completion_length,
        importance_sampling=importance_sampling_level,
        temperature=float(temperature),
        use_bias_correction_kl=bool(use_bias_correction_kl),
    )
    own = LOSS_TYPES[loss_type].options if loss_type in LOSS_TYPES else ()  # LossConfig names a bad loss_type
    by_type = dict(
        delta_clip=delta,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg,
    )
    return options | {name: value for name, value in by_type.items() if name in own}


def fused_linear_grpo(
    _input,
    weight,
    selected_token_ids,
    attention_mask,
    advantages,
    bias=None,
    ref_per_token_logps=None,
    old_per_token_logps=None,
    ref_input=None,
    ref_weight=None,
    ref_bias=None,
    beta=0.04,
    epsilon_low=0.2,
    epsilon_high=0.2,
    loss_type="dapo",
    max_completion_length=None,
    importance_sampling_level="token",
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    temperature=1.0,
    compiled=True,
    use_ref_model=True,
    chunk_size=1,
    vllm_is_ratio=None,
    delta=None,
    use_bias_correction_kl=False,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
    num_items_in_batch=None,
    *,
    cu_seqlens=None,
    backend: str = "auto",
    **options,
):
    """Liger's functional ``liger_fused_linear_grpo`` (same positional order and defaults), computed by
    the fused SAGE loss with the guide off: returns ``(loss, metrics)`` like `FusedLinearSAGELoss`.
    `cu_seqlens` takes packed sequences (`FusedLinearSAGELoss.forward`). Keyword `options` are
    further `LossConfig` fields (guide, gamma, ...)."""
    module = FusedLinearSAGELoss.from_liger(
        beta=beta,
        compiled=compiled,
        use_ref_model=use_ref_model,
        chunk_size=chunk_size,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        loss_type=loss_type,
        max_completion_length=max_completion_length,
        importance_sampling_level=importance_sampling_level,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        temperature=temperature,
        delta=delta,
        use_bias_correction_kl=use_bias_correction_kl,
        vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg,
        backend=backend,
        **options,
    )
    return module(
        _input,
        weight,
        selected_token_ids,
        attention_mask,
        advantages,
        bias,
        ref_per_token_logps,
        old_per_token_logps,
        ref_input,
        ref_weight,
        ref_bias,
        vllm_is_ratio,
        num_items_in_batch,
        cu_seqlens=cu_seqlens,
    )
