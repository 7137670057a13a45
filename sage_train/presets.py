"""Algorithms as named presets over the loss options and the trainer's batch shaping, and what a
resolved config trains: its `LossConfig` (`loss_config`); its guide is `guide.make_guide`'s.

A preset fills every config key left as None (`TrainConfig` loss options, the guide and
its schedule, DAPO's batch shaping, reward scaling); keys set in the YAML or on the
command line win. The resolved values are saved with the run.

| preset            | what it is                                                                          |
| ----------------- | ----------------------------------------------------------------------------------- |
| grpo              | GRPO, KL to the reference with beta 0.05 and TRL's k3 estimator                     |
| grpo-no-kl        | GRPO without the KL term (beta 0)                                                   |
| grpo-forward-kl   | GRPO with a forward-KL estimator (below)                                            |
| grpo-beta1.4x     | GRPO with beta 0.05 x q_max = 0.07: the branch loss's largest KL weight (below)     |
| grpo-kl-in-reward | GRPO with its KL(pi || pi_ref) in the reward, not the loss (verl's way)             |
| sage-branch       | SAGE with the branch guide q = clamp(1 + gamma (H - tau)+, q_min, q_max); default   |
| sage-token        | SAGE with the token (surprisal) guide, (alpha, sigma) on the official schedule      |
| sage-random       | SAGE with the random guide (eps of the tokens get q = 1 + sigma xi), the control    |
| sage-branch-exact | SAGE's objective: KL(pi || q pi_ref) in the reward, the branch guide's q            |
| sage-token-exact  | SAGE's objective with the token guide                                               |
| sage-random-exact | SAGE's objective with the random guide                                              |
| bnpo              | the paper's "BNPO (no KL)": loss_type bnpo, beta 0, nothing else changed            |
| dapo              | the paper's "DAPO (no KL)": loss_type dapo, beta 0, nothing else changed            |
| sage-branch-bnpo  | the paper's "BNPO + Branch": loss_type bnpo, beta 0.05, the branch guide            |
| sage-branch-dapo  | the paper's "DAPO + Branch": loss_type dapo, beta 0.05, the branch guide            |
| dapo-full         | DAPO with its extras: eps_high 0.28, no KL, dynamic sampling, overlong filtering    |
| dr_grpo           | Dr. GRPO: constant normaliser (B x max_new_tokens) and unscaled advantages r - mean |
| dppo-tv           | DPPO-Binary-TV: trust region |p - p_old| <= 0.15 on the token's probability, no KL  |
| dppo-kl           | DPPO-Binary-KL: the token's binary KL to the old policy <= 0.05, no KL              |
| sage-branch-dppo  | dppo-tv with beta 0.05 and the branch guide                                         |

The ``*-exact`` presets and grpo-kl-in-reward set ``kl_in_reward`` (`sage_train.rl_maths`): the
KL is measured at generation and enters the advantage as J's gradient asks, -beta (c - group mean
of c) beside the task reward's own group advantage, never divided by a std; the loss's beta is 0.
(Changed in issue 38: before, the KL came off the reward before the group statistics, so the
reward's std divided it too, and groups whose task rewards were all equal got the KL alone divided
by its own small std. docs/results/decisive and docs/results/kl-in-reward trained that form.) grpo-beta1.4x is the
control docs/convergence.md derives for the branch loss: in expectation its k3 term pulls each
position toward pi_ref with weight beta * q_s, q_s in [1, q_max], so the branch loss lies between
grpo (q_s = 1, the guide off) and grpo-beta1.4x (q_s = q_max = 1.4 everywhere); there is no
single factor, and no reason for one above q_max.

The token and random guides' schedule keys (``guide_alpha_*``, ``guide_sigma_*``, ``guide_eps_*``,
``guide_num_cycles``, ``guide_decay_rate``, ``guide_normalization``) default to the official
values of `sage_kernels.guides`; ``guide_sigma_*`` is the token guide's (0.25 -> 0.1) or the
random guide's (0.15 -> 0.05) by the resolved ``guide``.

The run's guide (``guide``: none, branch, token or random) and the ``guide_*`` keys are resolved here too;
the guides' settings (`GuideSettings`, `GUIDE_KEYS`) and `make_guide` live in `sage_train.guide`.

The DPPO presets take verl's recipe thresholds (its examples/dppo_trainer: 0.15 for dppo_tv, 0.05
for dppo_kl, on both sides; the ratio cap ``dppo_ratio_cap`` 20).

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
from sage_kernels.guides import GUIDES, NORMALIZATIONS, RANDOM_SCHEDULE, TOKEN_SCHEDULE

from .guide import GUIDE_KEYS, GuideSettings
from .records import settings_of
from .rl_maths import RewardSettings

#: LossConfig fields the trainer sets itself: the sampling temperature, dr_grpo's normaliser
#: (max_new_tokens), the per-step token count and the model's own logit scale and softcap (read from
#: its config by `policy.PolicyHead`); every other field is a config key.
TRAINER_SET = ("temperature", "max_completion_length", "num_items_in_batch", "logit_scale", "logit_softcap")
LOSS_KEYS = tuple(f.name for f in dataclasses.fields(LossConfig) if f.name not in TRAINER_SET)


#: what every preset starts from: the loss's own defaults (the official SAGE values), the guide
#: off with its settings' defaults (the sigma bounds follow the resolved guide: `apply_preset`), and
#: the trainer-level keys below
BASE = {
    **{name: getattr(LossConfig(), name) for name in LOSS_KEYS},
    "guide": "none",
    **dict(zip(GUIDE_KEYS, dataclasses.astuple(GuideSettings()))),
    "dynamic_sampling": False,
    "overlong_filter": False,
    "scale_rewards": True,
    "kl_in_reward": False,
}

PRESETS = {
    "grpo": {},
    "grpo-no-kl": {"beta": 0.0},
    "grpo-forward-kl": {"kl": "fk3"},
    "sage-branch": {"guide": "branch"},
    "sage-token": {"guide": "token"},
    "sage-random": {"guide": "random"},
    "bnpo": {"loss_type": "bnpo", "beta": 0.0},
    "dapo": {"loss_type": "dapo", "beta": 0.0},
    "sage-branch-bnpo": {"loss_type": "bnpo", "guide": "branch"},
    "sage-branch-dapo": {"loss_type": "dapo", "guide": "branch"},
    "dapo-full": {
        "beta": 0.0,
        "loss_type": "dapo",
        "eps_high": 0.28,
        "dynamic_sampling": True,
        "overlong_filter": True,
    },
    "dr_grpo": {"loss_type": "dr_grpo", "scale_rewards": False},
    "dppo-tv": {"loss_type": "dppo_tv", "eps_low": 0.15, "eps_high": 0.15, "beta": 0.0},
    "dppo-kl": {"loss_type": "dppo_kl", "eps_low": 0.05, "eps_high": 0.05, "beta": 0.0},
    "sage-branch-dppo": {"loss_type": "dppo_tv", "eps_low": 0.15, "eps_high": 0.15, "guide": "branch"},
    "grpo-beta1.4x": {"beta": round(LossConfig().beta * LossConfig().q_max, 12)},
    "grpo-kl-in-reward": {"kl_in_reward": True},
    "sage-branch-exact": {"guide": "branch", "kl_in_reward": True},
    "sage-token-exact": {"guide": "token", "kl_in_reward": True},
    "sage-random-exact": {"guide": "random", "kl_in_reward": True},
}

#: the trainer's ``guide`` names: no guide, or one of `sage_kernels.guides.GUIDES`
GUIDE_NAMES = ("none", *GUIDES)

#: the noise scale's (upper, lower) bounds of each scheduled guide (official values)
GUIDE_SIGMA = {"token": TOKEN_SCHEDULE["sigma"], "random": RANDOM_SCHEDULE["sigma"]}


class PresetError(ValueError):
    """The algorithm is unknown, or the options it resolves to are not a valid loss."""


def apply_preset(cfg):
    """`cfg` (a TrainConfig) with every None preset key filled from ``PRESETS[cfg.algorithm]``, then
    checked."""
    if cfg.algorithm not in PRESETS:
        raise PresetError(f"config key 'algorithm' must be one of {sorted(PRESETS)}, got {cfg.algorithm!r}")
    values = {**BASE, **PRESETS[cfg.algorithm]}
    guide = cfg.guide if cfg.guide is not None else values["guide"]
    values["guide_sigma_max"], values["guide_sigma_min"] = GUIDE_SIGMA.get(guide, GUIDE_SIGMA["token"])
    filled = {key: value for key, value in values.items() if getattr(cfg, key) is None}
    cfg = dataclasses.replace(cfg, **filled)
    if cfg.guide not in GUIDE_NAMES:
        raise PresetError(f"config key 'guide' must be one of {list(GUIDE_NAMES)}, got {cfg.guide!r}")
    check_guide_schedule(settings_of(GuideSettings, cfg, "guide_"))
    check_kl_in_reward(settings_of(RewardSettings, cfg))
    try:
        loss_config(cfg)
    except (ValueError, TypeError) as error:
        raise PresetError(f"loss options of algorithm {cfg.algorithm!r}: {error}") from error
    return cfg


def check_guide_schedule(settings: GuideSettings) -> None:
    """The token / random guides' schedule keys (``guide_<field>``), each failure naming its key."""

    def require(ok: bool, field: str, expected: str) -> None:
        if not ok:
            raise PresetError(f"config key 'guide_{field}' must be {expected}, got {getattr(settings, field)!r}")

    require(settings.num_cycles > 0, "num_cycles", "a positive integer")
    require(0 < settings.decay_rate <= 1, "decay_rate", "in (0, 1]")
    require(settings.normalization in NORMALIZATIONS, "normalization", f"one of {list(NORMALIZATIONS)}")
    for name in ("alpha", "sigma", "eps"):
        field = f"{name}_max"
        require(0 <= getattr(settings, f"{name}_min") <= getattr(settings, field), field, f">= guide_{name}_min >= 0")
    require(settings.eps_max <= 1, "eps_max", "a probability (<= 1)")


def check_kl_in_reward(reward: RewardSettings) -> None:
    """``kl_in_reward`` needs a KL weight, and its length option needs it on (else it would do nothing)."""
    if reward.kl_in_reward and reward.beta == 0:
        raise PresetError("config key 'beta' must be > 0 with kl_in_reward (it weighs the reward's KL), got 0")
    if reward.kl_in_reward_length_normalized and not reward.kl_in_reward:
        raise PresetError("config key 'kl_in_reward_length_normalized' needs kl_in_reward: true")


def loss_config(cfg) -> LossConfig:
    """The `LossConfig` of a resolved TrainConfig (the normaliser is set per step by the trainer).
    With ``kl_in_reward`` the KL and the guide are in the reward: the loss gets beta 0, no guide."""
    options = {name: getattr(cfg, name) for name in LOSS_KEYS}
    options["guide"] = GUIDES[cfg.guide].cls.loss_option if cfg.guide in GUIDES else "none"
    if cfg.kl_in_reward:
        options["beta"], options["guide"] = 0.0, "none"
    return LossConfig(**options, temperature=cfg.temperature, max_completion_length=cfg.max_new_tokens)
