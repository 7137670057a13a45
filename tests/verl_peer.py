"""verl 0.9.1's rollout-correction helpers for the tests: the installed verl's own module where verl
imports (its side environment, `make verl-suite`), else the same functions read verbatim from its
pinned wheel (`peer_source`). ``SAGE_REQUIRE_VERL=1`` (set by scripts/verl_suite.sh) makes a missing
verl an error instead of a fallback, so the side suite cannot pass without verl."""

from __future__ import annotations

import importlib.util
import math
import os
import typing
from types import SimpleNamespace

import torch
from peer_source import peer_functions

ROLLOUT_CORR_NAMES = (
    "SAFETY_BOUND",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS",
    "_parse_rollout_is_threshold",
    "_parse_rollout_rs_thresholds",
    "compute_rollout_rejection_mask",
    "compute_rs_metrics",
    "compute_rollout_correction_weights",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
)


def verl_installed() -> bool:
    found = importlib.util.find_spec("verl") is not None
    if not found and os.environ.get("SAGE_REQUIRE_VERL") == "1":
        raise RuntimeError("SAGE_REQUIRE_VERL=1 but verl does not import here")
    return found


def rollout_corr_helper():
    """verl's ``rollout_corr_helper`` functions `ROLLOUT_CORR_NAMES`, as attributes."""
    if verl_installed():
        import verl.trainer.ppo.rollout_corr_helper as helper

        return SimpleNamespace(**{name: getattr(helper, name) for name in ROLLOUT_CORR_NAMES})
    masked = peer_functions("verl", "verl/utils/torch_functional.py", ["masked_sum", "masked_mean"], {"torch": torch})
    scope = {"torch": torch, "math": math, "Optional": typing.Optional, "Any": object}
    scope["verl_F"] = SimpleNamespace(masked_sum=masked["masked_sum"], masked_mean=masked["masked_mean"])
    return SimpleNamespace(
        **peer_functions("verl", "verl/trainer/ppo/rollout_corr_helper.py", ROLLOUT_CORR_NAMES, scope)
    )
