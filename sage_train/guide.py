"""The trainer's guide (``guide``: none, branch, token or random; `sage_kernels.guides`): its settings and how a
run makes it. The branch guide's settings (gamma, tau, q_min, q_max) are loss options (`presets.LOSS_KEYS`). The
token and random guides' schedule is one frozen record, `GuideSettings`, whose defaults are the
official values of `sage_kernels.guides`; the trainer's keys ``guide_<field>`` derive from its fields
(`GUIDE_KEYS`: `TrainConfig` adds one key per field, as it adds one per loss option; a run reads them
back as this record, `records.settings_of(GuideSettings, cfg, "guide_")`), and `make_guide` gives each
guide the settings its row of `GUIDES` names. Which preset sets which of them is `sage_train.presets`'s."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sage_kernels import LossConfig
from sage_kernels.guides import (
    DECAY_RATE,
    GUIDES,
    NORMALIZATIONS,
    NUM_CYCLES,
    RANDOM_SCHEDULE,
    TOKEN_SCHEDULE,
    Guide,
    ScheduledGuide,
)


@dataclass(frozen=True)
class GuideSettings:
    """The token and random guides' schedule: (alpha, sigma) of the token guide and (eps, sigma) of the
    random one anneal from *_max to *_min within each of ``num_cycles`` cycles over the run's optimizer
    steps, the *_max bounds times ``decay_rate`` per cycle. ``sigma_*`` default to the token guide's
    official values; a preset takes the resolved guide's (`presets.GUIDE_SIGMA`)."""

    alpha_max: float = TOKEN_SCHEDULE["alpha"][0]
    alpha_min: float = TOKEN_SCHEDULE["alpha"][1]
    sigma_max: float = TOKEN_SCHEDULE["sigma"][0]
    sigma_min: float = TOKEN_SCHEDULE["sigma"][1]
    eps_max: float = RANDOM_SCHEDULE["eps"][0]
    eps_min: float = RANDOM_SCHEDULE["eps"][1]
    num_cycles: int = NUM_CYCLES
    decay_rate: float = DECAY_RATE
    normalization: str = NORMALIZATIONS[0]  # the token guide's: "minmax", "rank" or "zscore"


#: the trainer's guide keys, one per field of `GuideSettings`
GUIDE_KEYS = tuple(f"guide_{f.name}" for f in dataclasses.fields(GuideSettings))


def is_scheduled(guide: str) -> bool:
    """Whether the guide called `guide` anneals over the run's steps (its schedule follows ``steps``)."""
    return guide in GUIDES and issubclass(GUIDES[guide].cls, ScheduledGuide)


def make_guide(
    name: str, loss: LossConfig, settings: GuideSettings, *, steps: int, seed: int, rank: int
) -> Guide | None:
    """The run's guide `name` (`sage_kernels.guides.GUIDES[name]`), or None for ``guide: none``, given
    the settings its row names, drawn from: the loss options (gamma, tau, q_min, q_max), the
    `GuideSettings`, the run's optimizer steps (``max_steps``: a scheduled guide's schedule runs over
    them) and a per-rank ``seed`` for its noise (from the run's `seed`)."""
    if name not in GUIDES:
        return None
    available = {
        "gamma": loss.gamma,
        "tau": loss.tau,
        "q_min": loss.q_min,
        "q_max": loss.q_max,
        "max_steps": steps,
        "seed": seed * 1009 + rank,
        **dataclasses.asdict(settings),
    }
    kind = GUIDES[name]
    return kind.cls(**{name: available[name] for name in kind.settings})
