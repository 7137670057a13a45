"""The learning-rate schedule of every optimizer here: the RL trainer's, the warm start's, the toy's."""

from __future__ import annotations

import math

import torch


def lr_schedule(optimizer, kind: str, warmup_steps: int, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over `warmup_steps`, then `kind`: "constant", "cosine" to 0 or "linear" to 0
    at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        if kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        if kind == "linear":
            return max(0.0, 1 - progress)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
