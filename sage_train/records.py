"""A run's settings as frozen records: each part of the run reads the record defined beside the table
or code it chooses from (`rollout.base.RolloutSettings` beside the engines, `rl_maths.Corrections`
beside the importance-sampling levels and modes, `optim.OptimSettings` beside the learning-rate
schedules, ...), its fields named as the `TrainConfig` keys it reads, so that a function's signature
says which options it reads and the whole config does not travel. `TrainConfig` stays the user's
surface; `inputs.run_settings` picks every record out of a checked config once."""

from __future__ import annotations

import dataclasses


def settings_of(kind, cfg, prefix: str = ""):
    """The frozen record `kind` of a TrainConfig: each field the value of the key of its name (after
    `prefix`: the guide's keys are ``guide_<field>``)."""
    return kind(**{f.name: getattr(cfg, prefix + f.name) for f in dataclasses.fields(kind)})
