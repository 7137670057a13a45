"""Guide functions q > 0 for the SAGE anchor q * pi_ref, and their schedules.

The branch guide is computed inside the loss from the policy's own entropy (option
``guide="branch"``); `branch_guide` here is the same formula for callers who want q
outside the loss. The token (surprisal) and random guides are computed outside the loss
and passed to it as ``log_q``.

Schedules: the official SAGE code anneals the token and random guides' strength with a
cosine schedule that restarts every ``period`` optimizer steps. Its exact constants were
not available to us; `CosineRestartSchedule` is our reading (value falls from ``start``
to ``end`` along a half cosine within each period, then restarts), stepped once per
optimizer step by the trainer, with its position saved in checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


def branch_guide(entropy: torch.Tensor, *, gamma: float = 0.3, tau: float = 1.2,
                 q_min: float = 0.6, q_max: float = 1.4) -> torch.Tensor:
    """q = clamp(1 + gamma * max(H - tau, 0), q_min, q_max), with H in nats. No gradient."""
    return (1.0 + gamma * (entropy.detach() - tau).clamp(min=0.0)).clamp(q_min, q_max)


@dataclass
class CosineRestartSchedule:
    """A value that follows a half cosine from `start` to `end` over `period` steps, then restarts."""

    start: float
    end: float
    period: int
    step_count: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.period, int) and self.period > 0):
            raise ValueError(f"period must be a positive int, got {self.period!r}")

    def value(self, step: Optional[int] = None) -> float:
        step = self.step_count if step is None else step
        phase = (step % self.period) / self.period
        return self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * phase))

    def step(self) -> None:
        self.step_count += 1

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])


class TokenGuide:
    """Surprisal guide: q = clamp(1 + gamma_t * max(-log pi(y) - tau, 0), q_min, q_max).

    Raises the anchor on tokens the policy found surprising when it sampled them, so rare
    continuations are not pulled back to the reference's mode. `logp` is the behaviour
    policy's log-prob of each sampled token (no gradient); gamma_t follows the schedule.
    """

    def __init__(self, *, gamma: float = 0.3, gamma_end: float = 0.0, period: int = 100,
                 tau: float = 1.2, q_min: float = 0.6, q_max: float = 1.4) -> None:
        self.schedule = CosineRestartSchedule(gamma, gamma_end, period)
        self.tau, self.q_min, self.q_max = tau, q_min, q_max

    def __call__(self, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        surprisal = -logp.detach().float()
        q = (1.0 + self.schedule.value() * (surprisal - self.tau).clamp(min=0.0)).clamp(self.q_min, self.q_max)
        return torch.where(mask.bool(), q.log(), 0.0)

    def step(self) -> None:
        self.schedule.step()

    def state_dict(self) -> dict:
        return {"schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state["schedule"])


class RandomGuide:
    """Random guide: log q ~ N(0, sigma_t^2) per token, q clamped to [q_min, q_max].

    The control for the branch guide: the same amount of anchor reshaping, placed at
    random. Draws come from its own seeded generator, saved in checkpoints.
    """

    def __init__(self, *, sigma: float = 0.2, sigma_end: float = 0.0, period: int = 100,
                 q_min: float = 0.6, q_max: float = 1.4, seed: int = 0) -> None:
        self.schedule = CosineRestartSchedule(sigma, sigma_end, period)
        self.q_min, self.q_max = q_min, q_max
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, mask: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(mask.shape, generator=self.generator) * self.schedule.value()
        log_q = noise.clamp(math.log(self.q_min), math.log(self.q_max)).to(mask.device)
        return torch.where(mask.bool(), log_q, 0.0)

    def step(self) -> None:
        self.schedule.step()

    def state_dict(self) -> dict:
        return {"schedule": self.schedule.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state["schedule"])
        self.generator.set_state(state["generator"])
