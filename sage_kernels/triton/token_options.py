"""The token-stage kernel's options from `LossConfig`, one row per kernel parameter (`TOKEN_STAGE_OPTIONS`).

`token_stage._token_stage_kernel` takes, after its tensors and sizes, one parameter per row in the
table's order: the float32 scalars, then the compile-time flags and codes (Triton constexprs: each
value compiles its own variant). The launch passes `kernel_options(config)` by keyword, so a new
option is a row here and its parameter in the kernel's signature, which must stay spelled out
(Triton reads the parameter names from it and takes no ``**kwargs``);
tests/kernels/triton_backend/test_token_options.py checks that the two agree, name by name and in
order. The kernel's other constexprs come from the tensors (HAS_OLD..., by ``triton.heuristics``)
or the shape (BLOCK_L), not from the config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ..loss_types import LOSS_TYPES
from ..spec import KL_CODES, LossConfig


class KernelOption(NamedTuple):
    """One kernel parameter: its name, whether it is a Triton constexpr (else a float32 scalar), and
    how its value is read from a `LossConfig`."""

    name: str
    constexpr: bool
    read: Callable[[LossConfig], object]


def scalar(name: str, read: Callable[[LossConfig], object]) -> KernelOption:
    return KernelOption(name, False, read)


def constexpr(name: str, read: Callable[[LossConfig], object]) -> KernelOption:
    return KernelOption(name, True, read)


#: the kernel's options in its signature's order. An optional number (None: off) is 0.0 here and its
#: flag says whether the kernel reads it.
TOKEN_STAGE_OPTIONS = (
    scalar("beta", lambda c: c.beta),
    scalar("gamma", lambda c: c.gamma),
    scalar("tau", lambda c: c.tau),
    scalar("q_min", lambda c: c.q_min),
    scalar("q_max", lambda c: c.q_max),
    scalar("eps_low", lambda c: c.eps_low),
    scalar("eps_high", lambda c: c.eps_high),
    scalar("delta_clip", lambda c: c.delta_clip or 0.0),
    scalar("dual_clip_c", lambda c: c.dual_clip_c or 0.0),
    scalar("entropy_coef", lambda c: c.entropy_coef),
    scalar("sapo_t_pos", lambda c: c.sapo_temperature_pos),
    scalar("sapo_t_neg", lambda c: c.sapo_temperature_neg),
    scalar("vespo_k_pos", lambda c: c.vespo_k_pos),
    scalar("vespo_lambda_pos", lambda c: c.vespo_lambda_pos),
    scalar("vespo_k_neg", lambda c: c.vespo_k_neg),
    scalar("vespo_lambda_neg", lambda c: c.vespo_lambda_neg),
    scalar("kl_clamp", lambda c: c.kl_clamp or 0.0),
    scalar("off_policy_threshold", lambda c: c.off_policy_mask_threshold or 0.0),
    scalar("dppo_ratio_cap", lambda c: c.dppo_ratio_cap),
    constexpr("KL", lambda c: KL_CODES[c.kl]),
    constexpr("BRANCH", lambda c: c.guide == "branch"),
    constexpr("SEQUENCE", lambda c: c.importance_sampling == "sequence"),
    constexpr("LOSS", lambda c: LOSS_TYPES[c.loss_type].code),
    constexpr("PADDED", lambda c: c.luspo_include_padding),
    constexpr("PER_SEQUENCE_MEAN", lambda c: LOSS_TYPES[c.loss_type].aggregation == "sequence_mean"),
    constexpr("BIAS_CORRECTION", lambda c: c.use_bias_correction_kl),
    constexpr("HAS_DELTA", lambda c: c.delta_clip is not None),
    constexpr("HAS_DUAL", lambda c: c.dual_clip_c is not None),
    constexpr("HAS_KL_CLAMP", lambda c: c.kl_clamp is not None),
    constexpr("OFF_POLICY", lambda c: c.off_policy_mask_threshold is not None),
)


def kernel_options(config: LossConfig) -> dict:
    """The token-stage kernel's option arguments for `config` by parameter name: every scalar as a
    Python float (one float32 kernel argument, whatever number type the config holds), every
    constexpr as read."""
    return {
        option.name: option.read(config) if option.constexpr else float(option.read(config))
        for option in TOKEN_STAGE_OPTIONS
    }
