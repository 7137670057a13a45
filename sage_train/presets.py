"""Algorithms as named presets over the loss options and the trainer's batch shaping.

A preset fills every config key left as None (`TrainConfig` loss options, the guide and
its schedule, DAPO's batch shaping, reward scaling); keys set in the YAML or on the
command line win. The resolved values are saved with the run.

| preset           | what it is                                                                      |
| ---------------- | ------------------------------------------------------------------------------- |
| grpo             | GRPO, KL to the reference with beta 0.05 and TRL's k3 estimator                 |
| grpo-no-kl       | GRPO without the KL term (beta 0)                                               |
| grpo-forward-kl  | GRPO with a forward-KL estimator (below)                                        |
| sage-branch      | SAGE with the branch guide q = clamp(1 + gamma (H - tau)+, q_min, q_max); default|
| sage-token       | SAGE with the token (surprisal) guide, strength on a cosine with restarts        |
| sage-random      | SAGE with the random guide (log q ~ N(0, sigma^2)), the control for placement     |
| dapo             | token-level loss, eps_high 0.28, no KL, dynamic sampling, overlong filtering    |
| bnpo             | GRPO normalised by the batch's completion-token count                           |
| dr_grpo          | Dr. GRPO: constant normaliser (B x max_new_tokens) and unscaled advantages r - mean |

The forward-KL estimator. With delta = log(q pi_ref / pi) at a token sampled from pi and
r = exp(delta), the loss's k3 = r - 1 - delta is Schulman's estimator of the reverse
KL(pi || pi_ref) *value*. The same construction for the forward direction,
KL(pi_ref || pi) = E_pi[r log r], with the zero-mean control variate r - 1 subtracted, is

    fk3 = r * delta - (r - 1)          (>= 0, unbiased for KL(pi_ref || pi) under pi)

and grpo-forward-kl puts it in the loss where grpo puts k3 (beta 0.05, the same
convention of differentiating the per-token estimate), as the loss option ``kl="fk3"``.
(A note for readers comparing
gradients: differentiated as a loss, k3's expected gradient is that of the forward KL and
k2's that of the reverse KL; the presets follow TRL's value-estimator convention.)
"""

from __future__ import annotations

import dataclasses

from sage_kernels import LossConfig

#: LossConfig fields the trainer sets itself: the sampling temperature, dr_grpo's normaliser
#: (max_new_tokens) and the per-step token count; every other field is a config key.
TRAINER_SET = ("temperature", "max_completion_length", "num_items_in_batch")
LOSS_KEYS = tuple(f.name for f in dataclasses.fields(LossConfig) if f.name not in TRAINER_SET)

#: what every preset starts from: the loss's own defaults (the official SAGE values), the guide
#: off, and the trainer-level keys below
BASE = {
    **{name: getattr(LossConfig(), name) for name in LOSS_KEYS},
    "guide": "none",
    "guide_strength": 0.3,
    "guide_strength_end": 0.0,
    "guide_period": 100,
    "dynamic_sampling": False,
    "overlong_filter": False,
    "scale_rewards": True,
}

PRESETS = {
    "grpo": {},
    "grpo-no-kl": {"beta": 0.0},
    "grpo-forward-kl": {"kl": "fk3"},
    "sage-branch": {"guide": "branch"},
    "sage-token": {"guide": "token"},
    "sage-random": {"guide": "random", "guide_strength": 0.2},
    "dapo": {
        "beta": 0.0,
        "loss_type": "dapo",
        "eps_high": 0.28,
        "dynamic_sampling": True,
        "overlong_filter": True,
    },
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo", "scale_rewards": False},
}

#: trainer-level guides: "branch" is computed inside the loss, "token" and "random" outside it.
GUIDES = ("none", "branch", "token", "random")


class PresetError(ValueError):
    """The algorithm is unknown, or the options it resolves to are not a valid loss."""


def apply_preset(cfg):
    """`cfg` (a TrainConfig) with every None preset key filled from ``PRESETS[cfg.algorithm]``, then
    checked."""
    if cfg.algorithm not in PRESETS:
        raise PresetError(f"config key 'algorithm' must be one of {sorted(PRESETS)}, got {cfg.algorithm!r}")
    values = {**BASE, **PRESETS[cfg.algorithm]}
    filled = {key: value for key, value in values.items() if getattr(cfg, key) is None}
    cfg = dataclasses.replace(cfg, **filled)
    if cfg.guide not in GUIDES:
        raise PresetError(f"config key 'guide' must be one of {list(GUIDES)}, got {cfg.guide!r}")
    if cfg.guide_period <= 0:
        raise PresetError(f"config key 'guide_period' must be a positive integer, got {cfg.guide_period!r}")
    try:
        loss_config(cfg)
    except (ValueError, TypeError) as error:
        raise PresetError(f"loss options of algorithm {cfg.algorithm!r}: {error}") from error
    return cfg


def loss_config(cfg) -> LossConfig:
    """The `LossConfig` of a resolved TrainConfig (the normaliser is set per step by the trainer)."""
    options = {name: getattr(cfg, name) for name in LOSS_KEYS}
    options["guide"] = "branch" if cfg.guide == "branch" else "none"  # token / random: log_q from outside
    return LossConfig(**options, temperature=cfg.temperature, max_completion_length=cfg.max_new_tokens)
