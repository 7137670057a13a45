"""The run's guide (``guide``: none, branch, token or random; `sage_kernels.guides`) and its settings.

The branch guide's settings (gamma, tau, q_min, q_max) are loss options (`presets.LOSS_KEYS`). The
token and random guides' schedule is one frozen record, `GuideSettings`, whose defaults are the
official values of `sage_kernels.guides`; the trainer's keys ``guide_<field>`` derive from its fields
(`GUIDE_KEYS`: `TrainConfig` adds one key per field, as it adds one per loss option), and
`make_guide` reads them back through it (`guide_settings`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sage_kernels.guides import (
    DECAY_RATE,
    GUIDES,
    NORMALIZATIONS,
    NUM_CYCLES,
    RANDOM_SCHEDULE,
    TOKEN_SCHEDULE,
    BranchGuide,
    Guide,
    RandomGuide,
    ScheduledGuide,
    TokenGuide,
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


def guide_settings(cfg) -> GuideSettings:
    """The `GuideSettings` of a resolved TrainConfig (its ``guide_*`` keys)."""
    return GuideSettings(**{f.name: getattr(cfg, f"guide_{f.name}") for f in dataclasses.fields(GuideSettings)})


def is_scheduled(guide: str) -> bool:
    """Whether the guide called `guide` anneals over the run's steps (its schedule follows ``steps``)."""
    return guide in GUIDES and issubclass(GUIDES[guide], ScheduledGuide)


def make_guide(cfg, rank: int) -> Guide | None:
    """The run's guide (`sage_kernels.guides.GUIDES[cfg.guide]`), or None for ``guide: none``.
    A scheduled guide's schedule runs over the run's optimizer steps; its noise is seeded per rank."""
    bounds = {"q_min": cfg.q_min, "q_max": cfg.q_max}
    if cfg.guide == "branch":
        return BranchGuide(gamma=cfg.gamma, tau=cfg.tau, **bounds)
    settings = guide_settings(cfg)
    schedule = {
        "max_steps": cfg.steps,
        "sigma_max": settings.sigma_max,
        "sigma_min": settings.sigma_min,
        "num_cycles": settings.num_cycles,
        "decay_rate": settings.decay_rate,
        "seed": cfg.seed * 1009 + rank,
        **bounds,
    }
    if cfg.guide == "token":
        return TokenGuide(
            alpha_max=settings.alpha_max,
            alpha_min=settings.alpha_min,
            normalization=settings.normalization,
            **schedule,
        )
    if cfg.guide == "random":
        return RandomGuide(eps_max=settings.eps_max, eps_min=settings.eps_min, **schedule)
    return None
