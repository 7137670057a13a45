"""`FusedLinearSAGELoss`: the loss as an nn.Module with Liger-Kernel's GRPO forward signature.

Code written for ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` switches by
constructing this module instead: `forward` takes the same arguments and returns
``(loss, metrics)`` with Liger's metrics tuple (mean KL when beta != 0, then the clipped
fraction). The tuple also carries every SAGE metric by name in ``metrics.named``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .function import fused_linear_sage_loss, logprobs_and_entropy
from .spec import LossConfig


class SageMetrics(tuple):
    """Liger's metrics tuple, plus ``.named``: the dict of `SageLossOutput.metrics`."""

    named: dict

    def __new__(cls, values, named: dict):
        out = super().__new__(cls, values)
        out.named = named
        return out


class FusedLinearSAGELoss(nn.Module):
    """The SAGE loss over an LM head. Keyword arguments are `LossConfig` fields, plus `backend`."""

    def __init__(self, *, backend: str = "auto", **options) -> None:
        super().__init__()
        self.config = LossConfig(**options)
        self.backend = backend

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, config={self.config}"

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
        `vllm_is_ratio` ([B, T] or [B, 1]) multiplies the PG term."""
        config = self.config
        if num_items_in_batch is not None:
            config = config.replace(num_items_in_batch=num_items_in_batch)
        if ref_per_token_logps is None and ref_input is not None and config.beta != 0:
            head = lin_weight if ref_weight is None else ref_weight
            ref_per_token_logps, _ = logprobs_and_entropy(
                ref_input.detach(), head.detach(), selected_token_ids,
                bias=None if ref_bias is None else ref_bias.detach(),
                temperature=config.temperature, backend=self.backend)
        if vllm_is_ratio is not None:
            vllm_is_ratio = vllm_is_ratio.expand_as(selected_token_ids)
        out = fused_linear_sage_loss(
            _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=bias,
            old_logp=old_per_token_logps, ref_logp=ref_per_token_logps, is_weights=vllm_is_ratio,
            config=config, backend=self.backend)
        values = ([out.metrics["kl"]] if config.beta != 0 else []) + [out.metrics["clip_ratio/region_mean"]]
        return out.loss, SageMetrics(values, out.metrics)
