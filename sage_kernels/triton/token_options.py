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
from operator import attrgetter
from typing import NamedTuple

from ..loss_types import LOSS_TYPES
from ..spec import KL_CODES, LossConfig


class KernelOption(NamedTuple):
    """One kernel parameter: its name, whether it is a Triton constexpr (else a float32 scalar), and
    how its value is read from a `LossConfig`."""

    name: str
    constexpr: bool
    read: Callable[[LossConfig], object]


def scalar(name: str, field: str | None = None) -> KernelOption:
    """A float32 scalar: the config's `field` (default: the parameter's name)."""
    return KernelOption(name, False, attrgetter(field or name))


def optional(name: str, field: str | None = None) -> KernelOption:
    """A float32 scalar from an optional number: 0.0 when it is None (off), which the kernel then
    does not read (its `present` flag is False)."""
    value = attrgetter(field or name)
    return KernelOption(name, False, lambda config: value(config) or 0.0)


def present(name: str, field: str) -> KernelOption:
    """A constexpr flag: the config's optional `field` is given (not None; 0 is given)."""
    value = attrgetter(field)
    return KernelOption(name, True, lambda config: value(config) is not None)


def constexpr(name: str, read: Callable[[LossConfig], object]) -> KernelOption:
    """A constexpr: a flag or an integer code, as `read` gives it."""
    return KernelOption(name, True, read)


#: the kernel's options in its signature's order
TOKEN_STAGE_OPTIONS = (
    scalar("beta"),
    scalar("gamma"),
    scalar("tau"),
    scalar("q_min"),
    scalar("q_max"),
    scalar("eps_low"),
    scalar("eps_high"),
    optional("delta_clip"),
    optional("dual_clip_c"),
    scalar("entropy_coef"),
    scalar("sapo_t_pos", "sapo_temperature_pos"),
    scalar("sapo_t_neg", "sapo_temperature_neg"),
    scalar("vespo_k_pos"),
    scalar("vespo_lambda_pos"),
    scalar("vespo_k_neg"),
    scalar("vespo_lambda_neg"),
    optional("kl_clamp"),
    optional("off_policy_threshold", "off_policy_mask_threshold"),
    scalar("dppo_ratio_cap"),
    constexpr("KL", lambda c: KL_CODES[c.kl]),
    constexpr("BRANCH", lambda c: c.guide == "branch"),
    constexpr("SEQUENCE", lambda c: c.importance_sampling == "sequence"),
    constexpr("LOSS", lambda c: LOSS_TYPES[c.loss_type].code),
    constexpr("PADDED", attrgetter("luspo_include_padding")),
    constexpr("PER_SEQUENCE_MEAN", lambda c: LOSS_TYPES[c.loss_type].aggregation == "sequence_mean"),
    constexpr("BIAS_CORRECTION", attrgetter("use_bias_correction_kl")),
    present("HAS_DELTA", "delta_clip"),
    present("HAS_DUAL", "dual_clip_c"),
    present("HAS_KL_CLAMP", "kl_clamp"),
    present("OFF_POLICY", "off_policy_mask_threshold"),
)


def kernel_options(config: LossConfig) -> dict:
    """The token-stage kernel's option arguments for `config` by parameter name: every scalar as a
    Python float (one float32 kernel argument, whatever number type the config holds), every
    constexpr as read."""
    return {
        option.name: option.read(config) if option.constexpr else float(option.read(config))
        for option in TOKEN_STAGE_OPTIONS
    }
