"""Guide functions q > 0 for the SAGE anchor q * pi_ref, and their schedules.

Every guide is a `Guide`: ``log_q(logp, entropy, mask)`` of a batch's sampled tokens (their
log-probs and entropies under the policy, no gradient), ``step()`` once per optimizer step, and its
state for checkpoints. `GUIDES` maps the trainer's ``guide`` names to them (a `GuideKind`: the class
and the settings its constructor takes by name), and each guide's ``loss_option`` is the loss's own
``guide`` option it runs with: the branch guide is computed inside the fused loss from the same
forward's entropy (``guide="branch"``; its `log_q` is the same formula, for callers outside the loss,
such as a KL in the reward); the token (surprisal) and random guides are computed outside it and
passed as ``log_q`` (``guide="none"``). All three are the official SAGE
code's (github.com/tally0818/SAGE, commit c9b3b69), with its defaults:

- branch: q = clamp(1 + 0.3 * relu(H - 1.2), 0.6, 1.4), H the policy's entropy in nats.
- token: s = -log pi(y) of each sampled token under the current policy; per row, over its valid
  tokens, s is normalised to a weight w in [0, 1] (``minmax``: clamp s to its 5% / 95% quantiles,
  then (s - min) / max(max - min, 1e-6); ``rank``: rank / (n - 1); ``zscore``: sigmoid of the
  z-score, std with ddof 0); then q = clamp(1 + alpha * w + sigma * w * xi, 0.6, 1.4), xi ~ N(0, 1)
  per token. So q < 1 happens on surprising tokens when xi is negative enough.
- random: each valid token independently with probability eps gets q = 1 + sigma * xi, otherwise
  q = 1; clamped to [0.6, 1.4].

(alpha, sigma) and (eps, sigma) follow `CosineAnnealingScheduler`: a half cosine from an upper to
a lower bound within each of ``num_cycles`` cycles of ``max_steps // num_cycles`` steps, only the
upper bounds multiplied by ``decay_rate`` at each new cycle. The value is read before stepping,
and the guide steps once per optimizer step (the trainer calls `step`). Like the official code, the
stochastic guides draw per call (per loss call: per micro-batch). Masked positions get q = 1
(log q = 0). Draws come from the guide's own seeded generator; `state_dict` holds the schedule's
position and the generator, so a resumed run continues the same stream.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from .ordered import ordered_sum
from .spec import LossConfig

#: the guide's bounds and branch constants, written once: `LossConfig`'s defaults (the official values)
_DEFAULTS = LossConfig()

#: the official schedules, written once: each annealed value's (upper, lower) bound, and the cycles
TOKEN_SCHEDULE = {"alpha": (0.3, 0.1), "sigma": (0.25, 0.1)}
RANDOM_SCHEDULE = {"eps": (0.1, 0.0), "sigma": (0.15, 0.05)}
NUM_CYCLES, DECAY_RATE = 8, 0.9


class Guide(Protocol):
    """q for the anchor q * pi_ref, fixed for the loss call it is drawn for."""

    #: the loss's own ``guide`` option with this guide: "branch" (the loss computes q) or "none" (q is log_q)
    loss_option: ClassVar[str]
    #: whether log_q reads the log-probs and entropies (False: the caller may pass None and skip the sweep)
    reads_policy: ClassVar[bool]

    def log_q(self, logp: torch.Tensor | None, entropy: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """log q [B, L] of the sampled tokens (0 where masked), from their log-probs and entropies."""

    def schedule_values(self) -> dict[str, float]:
        """The schedule's current values, as metrics ({} for an unscheduled guide)."""

    def step(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def branch_guide(
    entropy: torch.Tensor,
    *,
    gamma: float = _DEFAULTS.gamma,
    tau: float = _DEFAULTS.tau,
    q_min: float = _DEFAULTS.q_min,
    q_max: float = _DEFAULTS.q_max,
) -> torch.Tensor:
    """q = clamp(1 + gamma * max(H - tau, 0), q_min, q_max), with H in nats. No gradient."""
    return (1.0 + gamma * (entropy.detach() - tau).clamp(min=0.0)).clamp(q_min, q_max)


class BranchGuide:
    """The branch guide as a `Guide`: `branch_guide` of the entropy, no schedule, no state. In the loss
    it is computed by the kernels themselves (``loss_option`` "branch"), from the same forward."""

    loss_option: ClassVar[str] = "branch"
    reads_policy: ClassVar[bool] = True

    def __init__(
        self,
        *,
        gamma: float = _DEFAULTS.gamma,
        tau: float = _DEFAULTS.tau,
        q_min: float = _DEFAULTS.q_min,
        q_max: float = _DEFAULTS.q_max,
    ) -> None:
        self.gamma, self.tau, self.q_min, self.q_max = gamma, tau, q_min, q_max

    def log_q(self, logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = branch_guide(entropy, gamma=self.gamma, tau=self.tau, q_min=self.q_min, q_max=self.q_max)
        return torch.where(mask.bool(), q.log(), 0.0)

    def schedule_values(self) -> dict[str, float]:
        return {}

    def step(self) -> None:
        pass  # no schedule

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict | None) -> None:
        pass  # stateless (a checkpoint from before branch runs had a guide object holds None)


class CosineAnnealingScheduler:
    """Two values (a, b), each on a half cosine from its upper to its lower bound within a cycle.

    cycle_length = max(1, max_steps // num_cycles). `value()` at count c is, with
    t = (c mod cycle_length) / cycle_length, a = lb_a + (ub_a - lb_a) * (1 + cos(pi t)) / 2 (b alike).
    `step()` counts one step; when the count reaches a multiple of cycle_length and fewer than
    ``num_cycles - 1`` cycles have passed, a new cycle starts and only the upper bounds are
    multiplied by ``decay_rate`` (the lower bounds stay).
    """

    def __init__(
        self,
        max_steps: int,
        ub_a: float,
        lb_a: float,
        ub_b: float,
        lb_b: float,
        *,
        num_cycles: int = NUM_CYCLES,
        decay_rate: float = DECAY_RATE,
    ) -> None:
        if not (isinstance(max_steps, int) and max_steps > 0):
            raise ValueError(f"max_steps must be a positive int, got {max_steps!r}")
        if not (isinstance(num_cycles, int) and num_cycles > 0):
            raise ValueError(f"num_cycles must be a positive int, got {num_cycles!r}")
        if not 0 < decay_rate <= 1:
            raise ValueError(f"decay_rate must be in (0, 1], got {decay_rate!r}")
        self.lb_a, self.lb_b = float(lb_a), float(lb_b)
        self.initial_ub = (float(ub_a), float(ub_b))
        self.num_cycles, self.decay_rate = num_cycles, float(decay_rate)
        self.cycle_length = max(1, max_steps // num_cycles)
        self.count, self.cycle = 0, 0
        self.ub_a, self.ub_b = self.initial_ub

    def value(self) -> tuple[float, float]:
        t = (self.count % self.cycle_length) / self.cycle_length
        anneal = 0.5 * (1.0 + math.cos(math.pi * t))
        return self.lb_a + (self.ub_a - self.lb_a) * anneal, self.lb_b + (self.ub_b - self.lb_b) * anneal

    def step(self) -> None:
        self.count += 1
        if self.count % self.cycle_length == 0 and self.cycle < self.num_cycles - 1:
            self.cycle += 1
            self.ub_a *= self.decay_rate  # repeated products, as the official code computes them
            self.ub_b *= self.decay_rate

    def state_dict(self) -> dict:
        return {"count": self.count, "cycle": self.cycle, "ub_a": self.ub_a, "ub_b": self.ub_b}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.cycle = int(state["count"]), int(state["cycle"])
        self.ub_a, self.ub_b = float(state["ub_a"]), float(state["ub_b"])


#: the token guide's normalisations of the surprisal to a weight in [0, 1]; the first is the official default
NORMALIZATIONS = ("minmax", "rank", "zscore")


def surprisal_weights(
    surprisal: torch.Tensor, mask: torch.Tensor, normalization: str = NORMALIZATIONS[0]
) -> torch.Tensor:
    """w in [0, 1], [B, L]: each row's surprisal normalised over that row's valid tokens only
    (module docstring); 0 at masked positions and on rows without a valid token. Float32."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    s, mask = surprisal.detach().float(), mask.bool()
    count = mask.sum(-1, keepdim=True)  # [B, 1]
    if normalization == "zscore":
        n = count.clamp(min=1)
        mean = ordered_sum(torch.where(mask, s, 0.0), -1, keepdim=True) / n
        std = (ordered_sum(torch.where(mask, (s - mean) ** 2, 0.0), -1, keepdim=True) / n).sqrt().clamp(min=1e-6)
        w = torch.sigmoid((s - mean) / std)
    else:
        # valid values first, in ascending order; masked positions sort last
        order = torch.where(mask, s, math.inf).sort(dim=-1, stable=True).indices
        if normalization == "rank":
            rank = order.argsort(-1).float()
            w = rank / (count - 1).clamp(min=1)
        else:
            ordered = s.gather(-1, order)
            low, high = _quantile(ordered, count, 0.05), _quantile(ordered, count, 0.95)
            clamped = torch.minimum(torch.maximum(s, low), high)
            smallest = torch.where(mask, clamped, math.inf).amin(-1, keepdim=True)
            largest = torch.where(mask, clamped, -math.inf).amax(-1, keepdim=True)
            w = (clamped - smallest) / (largest - smallest).clamp(min=1e-6)
    return torch.where(mask, w.clamp(0.0, 1.0), 0.0)


def _quantile(ordered: torch.Tensor, count: torch.Tensor, p: float) -> torch.Tensor:
    """torch.quantile's linear interpolation over each row's first `count` sorted values, [B, 1]."""
    position = (count - 1).clamp(min=0).float() * p
    below = position.floor().long()
    above = position.ceil().long()
    low, high = ordered.gather(-1, below), ordered.gather(-1, above)
    return low + (high - low) * (position - below.float())


class ScheduledGuide:
    """A stochastic guide whose two values (a strength and a noise scale) follow a
    `CosineAnnealingScheduler` over ``max_steps``, drawing from its own seeded generator."""

    loss_option: ClassVar[str] = "none"
    reads_policy: ClassVar[bool] = True
    #: the metric names of the schedule's two values
    value_names = ("guide/strength", "guide/sigma")

    def __init__(self, max_steps, bounds, *, num_cycles, decay_rate, q_min, q_max, seed) -> None:
        self.schedule = CosineAnnealingScheduler(max_steps, *bounds, num_cycles=num_cycles, decay_rate=decay_rate)
        self.q_min, self.q_max = q_min, q_max
        self.generator = torch.Generator().manual_seed(seed)

    def schedule_values(self) -> dict[str, float]:
        return dict(zip(self.value_names, self.schedule.value()))

    def step(self) -> None:
        self.schedule.step()

    def state_dict(self) -> dict:
        return {"schedule": self.schedule.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state["schedule"])
        self.generator.set_state(state["generator"])


class TokenGuide(ScheduledGuide):
    """The token (surprisal) guide: q = clamp(1 + alpha * w + sigma * w * xi, q_min, q_max), w from
    `surprisal_weights` of -logp (the current policy's log-prob of each sampled token). (alpha,
    sigma) anneal from (alpha_max, sigma_max) to (alpha_min, sigma_min)."""

    def __init__(
        self,
        *,
        max_steps: int,
        alpha_max: float = TOKEN_SCHEDULE["alpha"][0],
        alpha_min: float = TOKEN_SCHEDULE["alpha"][1],
        sigma_max: float = TOKEN_SCHEDULE["sigma"][0],
        sigma_min: float = TOKEN_SCHEDULE["sigma"][1],
        normalization: str = NORMALIZATIONS[0],
        num_cycles: int = NUM_CYCLES,
        decay_rate: float = DECAY_RATE,
        q_min: float = _DEFAULTS.q_min,
        q_max: float = _DEFAULTS.q_max,
        seed: int = 0,
    ) -> None:
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
        bounds = (alpha_max, alpha_min, sigma_max, sigma_min)
        super().__init__(
            max_steps, bounds, num_cycles=num_cycles, decay_rate=decay_rate, q_min=q_min, q_max=q_max, seed=seed
        )
        self.normalization = normalization

    def log_q(self, logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        alpha, sigma = self.schedule.value()
        w = surprisal_weights(-logp.detach().float(), mask, self.normalization)
        xi = torch.randn(w.shape, generator=self.generator).to(w.device)
        q = (1.0 + alpha * w + sigma * w * xi).clamp(self.q_min, self.q_max)
        return torch.where(mask.bool(), q.log(), 0.0)


class RandomGuide(ScheduledGuide):
    """The random guide, the control for where the anchor is reshaped: each valid token with
    probability eps gets q = clamp(1 + sigma * xi, q_min, q_max), xi ~ N(0, 1); the others q = 1.
    It reads neither log-probs nor entropies. (eps, sigma) anneal from (eps_max, sigma_max) to
    (eps_min, sigma_min)."""

    reads_policy: ClassVar[bool] = False

    def __init__(
        self,
        *,
        max_steps: int,
        eps_max: float = RANDOM_SCHEDULE["eps"][0],
        eps_min: float = RANDOM_SCHEDULE["eps"][1],
        sigma_max: float = RANDOM_SCHEDULE["sigma"][0],
        sigma_min: float = RANDOM_SCHEDULE["sigma"][1],
        num_cycles: int = NUM_CYCLES,
        decay_rate: float = DECAY_RATE,
        q_min: float = _DEFAULTS.q_min,
        q_max: float = _DEFAULTS.q_max,
        seed: int = 0,
    ) -> None:
        bounds = (eps_max, eps_min, sigma_max, sigma_min)
        super().__init__(
            max_steps, bounds, num_cycles=num_cycles, decay_rate=decay_rate, q_min=q_min, q_max=q_max, seed=seed
        )

    def log_q(self, logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        eps, sigma = self.schedule.value()
        perturbed = torch.rand(mask.shape, generator=self.generator) < eps
        xi = torch.randn(mask.shape, generator=self.generator)
        q = torch.where(perturbed, 1.0 + sigma * xi, 1.0).clamp(self.q_min, self.q_max).to(mask.device)
        return torch.where(mask.bool(), q.log(), 0.0)


@dataclass(frozen=True)
class GuideKind:
    """One row of `GUIDES`: a guide's class, and the settings its constructor takes by name (read
    from the constructor itself, so a new guide is one row and its settings are never listed twice)."""

    cls: type

    @property
    def settings(self) -> tuple[str, ...]:
        return tuple(inspect.signature(self.cls).parameters)


#: the guides by the trainer's ``guide`` name ("none": no guide, q = 1)
GUIDES = {"branch": GuideKind(BranchGuide), "token": GuideKind(TokenGuide), "random": GuideKind(RandomGuide)}
