"""`FusedLinearSAGELoss`: the loss as an nn.Module with Liger-Kernel's GRPO forward signature.

Code written for ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` switches in one line:
``LigerFusedLinearGRPOLoss(**kw)`` becomes ``FusedLinearSAGELoss.from_liger(**kw)``, which takes
Liger's constructor arguments and defaults (guide off), and `forward` takes Liger's arguments
and returns ``(loss, metrics)`` with Liger's metrics tuple: the mean KL when beta != 0, then
the clipped fraction. Add ``guide="branch"`` to turn the plain KL anchor into SAGE's.
The tuple also carries every SAGE metric by name in ``metrics.named``.

Where Liger's semantics differ from TRL's (which `LossConfig` follows), `forward` follows Liger:
- the clipped fraction is measured on the ratio before the ``delta`` cap (TRL: after);
- ``num_items_in_batch`` given to `forward` (dapo) is the count over all processes; it is
  divided by the world size here, and when neither `forward` nor the config gives one, the
  mask sum is all-reduced, as Liger does. A ``num_items_in_batch`` in the config keeps
  `LossConfig`'s meaning (this process's divisor).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .function import fused_linear_sage_loss, logprobs_and_entropy
from .spec import LossConfig

#: Liger's constructor names -> `LossConfig` fields.
LIGER_OPTION_NAMES = {"epsilon_low": "eps_low", "epsilon_high": "eps_high", "delta": "delta_clip",
                      "importance_sampling_level": "importance_sampling"}
#: Liger's loss types without a counterpart in `LossConfig`.
LIGER_ONLY_LOSS_TYPES = ("cispo", "sapo", "luspo", "vespo")


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
    def from_liger(cls, *, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True,
                   chunk_size: int = 1, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                   loss_type: str = "dapo", max_completion_length: Optional[int] = None,
                   importance_sampling_level: str = "token", temperature: float = 1.0,
                   delta: Optional[float] = None, use_bias_correction_kl: bool = False,
                   backend: str = "auto", **options) -> "FusedLinearSAGELoss":
        """A module computing what ``LigerFusedLinearGRPOLoss(...)`` computes with the same arguments.

        `compiled` and `chunk_size` are Liger's execution knobs (torch.compile of its loss maths,
        rows per chunk); the fused kernels tile on their own, so they select nothing here.
        Liger-only features (the cispo/sapo/luspo/vespo loss types, `use_bias_correction_kl`)
        raise ValueError. `options` are further `LossConfig` fields (guide, gamma, ...).
        """
        if loss_type in LIGER_ONLY_LOSS_TYPES:
            raise ValueError(f"loss_type {loss_type!r} is Liger-only; supported: grpo, bnpo, dr_grpo, dapo")
        if use_bias_correction_kl:
            raise ValueError("use_bias_correction_kl=True is not supported by the SAGE loss")
        if loss_type == "dr_grpo" and max_completion_length is None:
            raise ValueError("max_completion_length is required for loss_type 'dr_grpo', as in Liger")
        del compiled, chunk_size
        options = {"guide": "none", "kl": "k3", **options}
        return cls(backend=backend, use_ref_model=use_ref_model, beta=beta, eps_low=epsilon_low,
                   eps_high=epsilon_high, loss_type=loss_type, max_completion_length=max_completion_length,
                   importance_sampling=importance_sampling_level, temperature=temperature,
                   delta_clip=delta, **options)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, use_ref_model={self.use_ref_model}, config={self.config}"

    def forward(self, _input: torch.Tensor, lin_weight: torch.Tensor, selected_token_ids: torch.Tensor,
                attention_mask: torch.Tensor, advantages: torch.Tensor, bias: Optional[torch.Tensor] = None,
                ref_per_token_logps: Optional[torch.Tensor] = None,
                old_per_token_logps: Optional[torch.Tensor] = None, ref_input: Optional[torch.Tensor] = None,
                ref_weight: Optional[torch.Tensor] = None, ref_bias: Optional[torch.Tensor] = None,
                vllm_is_ratio: Optional[torch.Tensor] = None, num_items_in_batch=None):
        """Liger's arguments: `_input` [B, T, D] hidden states, `lin_weight` [V, D], the sampled
        `selected_token_ids` [B, T], `attention_mask` [B, T] (completion mask), `advantages` [B].
        Reference log-probs come from `ref_per_token_logps`, or are computed from `ref_input`
        with `ref_weight` / `ref_bias` (the policy's head when `ref_weight` is None).
        `vllm_is_ratio` ([B], [B, 1] or [B, T]) multiplies the PG term."""
        config = self.config
        if not self.use_ref_model:
            # Liger then anchors to the policy itself: the KL is 0 with zero gradient.
            ref_per_token_logps = ref_input = None
            config = config.replace(beta=0.0)
        liger_divisor = num_items_in_batch is not None or config.num_items_in_batch is None
        if config.loss_type == "dapo" and liger_divisor:
            normaliser = _liger_dapo_normaliser(attention_mask, num_items_in_batch)
            config = config.replace(num_items_in_batch=normaliser)
        if ref_per_token_logps is None and ref_input is not None and config.beta != 0:
            head = lin_weight if ref_weight is None else ref_weight
            ref_per_token_logps, _ = logprobs_and_entropy(
                ref_input.detach(), head.detach(), selected_token_ids,
                bias=None if ref_bias is None else ref_bias.detach(),
                temperature=config.temperature, backend=self.backend)
        if vllm_is_ratio is not None:
            vllm_is_ratio = vllm_is_ratio.reshape(vllm_is_ratio.shape[0], -1).expand_as(selected_token_ids)
        out = fused_linear_sage_loss(
            _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=bias,
            old_logp=old_per_token_logps, ref_logp=ref_per_token_logps, is_weights=vllm_is_ratio,
            config=config, backend=self.backend)
        values = [out.metrics["kl"]] if self.config.beta != 0 else []
        values.append(_liger_clip_fraction(out.ratio, advantages, attention_mask, config))
        return out.loss, SageMetrics(values, out.metrics)


def _liger_dapo_normaliser(mask: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    """Liger's dapo divisor: the completion-token count over all processes, per process, at least 1."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    world_size = torch.distributed.get_world_size() if distributed else 1
    if num_items_in_batch is None:
        total = mask.float().sum()
        if distributed:
            torch.distributed.all_reduce(total)
    else:
        total = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=mask.device)
    return (total / world_size).clamp(min=1.0)


def _liger_clip_fraction(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                         config: LossConfig) -> torch.Tensor:
    """Fraction of unmasked tokens whose ratio (before the delta cap) is clipped in the advantage's sign."""
    A = advantages.detach()
    A = A[:, None] if A.dim() == 1 else A
    clipped = ((ratio < 1.0 - config.eps_low) & (A < 0)) | ((ratio > 1.0 + config.eps_high) & (A > 0))
    m = mask.float()
    return (clipped.float() * m).sum() / m.sum().clamp(min=1.0)
