"""How the policy is optimised: its settings (`OptimSettings`: AdamW, the learning-rate schedule,
gradient clipping, DeepSpeed's ZeRO stage and bf16, the loss backend) and `lr_schedule`, the one
learning-rate schedule of every optimizer here (the RL trainer's, the warm start's, the toy's)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: the learning-rate schedules after the warmup (`lr_schedule`): constant, cosine to 0, linear to 0
LR_SCHEDULES = ("constant", "cosine", "linear")
#: ``zero_stage``'s values: DeepSpeed's ZeRO stages
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class OptimSettings:
    """How the policy is optimised (`build.build_engines`, `inputs.deepspeed_config`): AdamW's
    learning rate on `lr_schedule`'s ``lr_schedule`` over ``steps`` x ``num_iterations`` updates, the
    gradient clipping, DeepSpeed's ZeRO stage and bf16 (merged with a ``deepspeed_config`` file), the
    loss backend and activation checkpointing of `policy.PolicyHead`."""

    lr: float
    lr_schedule: str
    warmup_steps: int
    weight_decay: float
    max_grad_norm: float
    steps: int
    num_iterations: int
    micro_batch_size: int
    zero_stage: int
    bf16: bool
    deepspeed_config: str
    loss_backend: str
    gradient_checkpointing: bool


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
