"""Truncated importance sampling (TIS) between the rollout engine and the trainer.

A rollout engine (vLLM) samples from numerically different log-probs than the trainer
computes for the same weights. The PG term is reweighted by w = min(pi_train / pi_rollout, cap)
per token ("token") or with one weight per sequence from the mean log-ratio ("sequence"),
and passed to the loss as `is_weights` (it multiplies the PG term only).

Both log-probs are of the same distribution: the temperature-scaled one *before* top-k / top-p /
min-p truncation. The trainer computes exactly that; the engines report it (hf: from the raw
logits; vllm: ``raw_logprobs`` at temperature 1, as the official SAGE code does, and
``processed_logprobs`` at other temperatures, which the config only allows without truncation,
since vLLM's processed log-probs come after the cuts). The weights then correct only the
engine/trainer mismatch and are 1 where the two agree. Against the truncated distribution, each
token's weight would be its kept probability mass (<= 1), smallest exactly at the high-entropy
forks the branch guide targets.
"""

from __future__ import annotations

import torch

IS_LEVELS = ("token", "sequence")


def truncated_is_weights(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *, level: str = "token", cap: float = 2.0
) -> torch.Tensor:
    """[B, L] weights min(exp(train_logp - rollout_logp), cap), 1 at masked positions; no gradient."""
    if level not in IS_LEVELS:
        raise ValueError(f"level must be one of {list(IS_LEVELS)}, got {level!r}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap!r}")
    mask = mask.bool()
    log_ratio = torch.where(mask, train_logp.detach().float() - rollout_logp.float(), 0.0)
    if level == "sequence":
        count = mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = (log_ratio.sum(-1, keepdim=True) / count).expand_as(log_ratio)
    return torch.where(mask, log_ratio.exp().clamp(max=cap), 1.0)
