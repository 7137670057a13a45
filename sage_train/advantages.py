"""Group-relative advantages (GRPO): each completion is compared with the others of its prompt."""

from __future__ import annotations

import torch

STD_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, *, scale: bool = True) -> torch.Tensor:
    """Advantages of rewards [G, n] (G prompts, n completions each).

    (r - mean) / (std + 1e-4) within each group, with the unbiased std as TRL computes it;
    ``scale=False`` gives r - mean (Dr. GRPO). A group whose rewards are all equal gets
    exactly zero (its mean may differ from its members by a rounding error).
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must have shape [groups, n >= 2], got {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    advantages = centred / (rewards.std(dim=1, keepdim=True) + STD_EPS) if scale else centred
    all_equal = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(advantages), advantages)
