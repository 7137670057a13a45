"""The token-stage kernel's option table (`token_options.TOKEN_STAGE_OPTIONS`) against the kernel and
the launch it replaced.

Triton takes the kernel's parameters from its spelled-out signature, so the table's rows must name
them, in order and with their kind (``tl.constexpr`` or a float32 scalar); and every row must give the
value the hand-written launch of `token_stage` passed for a config (the expected values here are
spelled from `LossConfig`'s fields, as that launch did, not read from the table).
"""

from __future__ import annotations

import inspect

import pytest

from sage_kernels import LossConfig
from sage_kernels.loss_types import LOSS_TYPES
from sage_kernels.spec import KL_CODES
from sage_kernels.triton import token_stage
from sage_kernels.triton.token_options import TOKEN_STAGE_OPTIONS, kernel_options

#: the kernel's parameters that do not come from the config: its tensors, its sizes, and the layout
#: of its row statistics and its chunk (the heuristics' flags are read from the kernel)
TENSORS = (
    "logp_ptr",
    "entropy_ptr",
    "mask_ptr",
    "adv_ptr",
    "old_ptr",
    "ref_ptr",
    "isw_ptr",
    "log_q_ptr",
    "sampling_ptr",
    "threshold_ptr",
    "inv_norm_ptr",
    "q_ptr",
    "kl_ptr",
    "ratio_ptr",
    "g_ptr",
    "c_ptr",
    "row_stats_ptr",
)
SIZES = ("B", "L")
LAYOUT = ("COLUMNS", "BLOCK_L")


def kernel_signature():
    """(the jit function's parameter names, the Python function's signature, the heuristics' flags)."""
    heuristics = token_stage._token_stage_kernel
    jit = heuristics.fn  # a JITFunction, or an InterpretedFunction under TRITON_INTERPRET=1
    return list(jit.arg_names), inspect.signature(jit.fn), list(heuristics.values)


def test_the_table_names_the_kernels_parameters_in_order():
    arg_names, signature, flags = kernel_signature()
    table = [option.name for option in TOKEN_STAGE_OPTIONS]
    assert len(set(table)) == len(table)
    assert arg_names == list(TENSORS + SIZES) + table + flags + list(LAYOUT)
    assert list(signature.parameters) == arg_names
    kinds = {name: "constexpr" in str(param.annotation) for name, param in signature.parameters.items()}
    assert {option.name: kinds[option.name] for option in TOKEN_STAGE_OPTIONS} == {
        option.name: option.constexpr for option in TOKEN_STAGE_OPTIONS
    }
    assert not any(kinds[name] for name in TENSORS + SIZES)
    assert all(kinds[name] for name in flags + list(LAYOUT))


def hand_written_launch(c: LossConfig) -> dict:
    """The options token_stage's launch passed before the table, as it spelled them."""
    return dict(
        beta=float(c.beta),
        gamma=float(c.gamma),
        tau=float(c.tau),
        q_min=float(c.q_min),
        q_max=float(c.q_max),
        eps_low=float(c.eps_low),
        eps_high=float(c.eps_high),
        delta_clip=float(c.delta_clip or 0.0),
        dual_clip_c=float(c.dual_clip_c or 0.0),
        entropy_coef=float(c.entropy_coef),
        sapo_t_pos=float(c.sapo_temperature_pos),
        sapo_t_neg=float(c.sapo_temperature_neg),
        vespo_k_pos=float(c.vespo_k_pos),
        vespo_lambda_pos=float(c.vespo_lambda_pos),
        vespo_k_neg=float(c.vespo_k_neg),
        vespo_lambda_neg=float(c.vespo_lambda_neg),
        kl_clamp=float(c.kl_clamp or 0.0),
        off_policy_threshold=float(c.off_policy_mask_threshold or 0.0),
        dppo_ratio_cap=float(c.dppo_ratio_cap),
        KL=KL_CODES[c.kl],
        BRANCH=c.guide == "branch",
        SEQUENCE=c.importance_sampling == "sequence",
        LOSS=LOSS_TYPES[c.loss_type].code,
        PADDED=c.luspo_include_padding,
        PER_SEQUENCE_MEAN=LOSS_TYPES[c.loss_type].aggregation == "sequence_mean",
        BIAS_CORRECTION=c.use_bias_correction_kl,
        HAS_DELTA=c.delta_clip is not None,
        HAS_DUAL=c.dual_clip_c is not None,
        HAS_KL_CLAMP=c.kl_clamp is not None,
        OFF_POLICY=c.off_policy_mask_threshold is not None,
    )


CONFIGS = {
    "default": {},
    # every scalar a different number, every optional one given, every flag off its default: a row
    # reading a neighbour's field or the wrong flag shows
    "every option": dict(
        loss_type="dapo",
        beta=0.07,
        kl="fk3",
        guide="none",
        gamma=0.11,
        tau=1.3,
        q_min=0.55,
        q_max=1.45,
        eps_low=0.21,
        eps_high=0.28,
        delta_clip=3.5,
        dual_clip_c=2.5,
        importance_sampling="sequence",
        entropy_coef=0.013,
        sapo_temperature_pos=0.9,
        sapo_temperature_neg=1.15,
        vespo_k_pos=2.2,
        vespo_lambda_pos=3.3,
        vespo_k_neg=3.4,
        vespo_lambda_neg=2.1,
        use_bias_correction_kl=True,
        kl_clamp=17.0,
        off_policy_mask_threshold=0.45,
        dppo_ratio_cap=6,  # an int: the kernel still gets a float
    ),
    "luspo padded": dict(loss_type="luspo", luspo_include_padding=True, kl="k1+"),
    "gmpo": dict(loss_type="gmpo", kl="k3+", eps_low=0.4, eps_high=0.4),
    "cispo": dict(loss_type="cispo", eps_high=5.0, kl="k2", beta=0.0),
    # a threshold of 0 is on (None is off): the flag reads presence, not truth
    "off-policy at 0": dict(loss_type="sapo", off_policy_mask_threshold=0.0, kl="k1"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_row_passes_what_the_hand_written_launch_passed(name):
    config = LossConfig(**CONFIGS[name])
    options = kernel_options(config)
    expected = hand_written_launch(config)
    assert options == expected
    # the same types too: True == 1, but a constexpr's type is part of the variant compiled
    assert {key: type(value) for key, value in options.items()} == {key: type(value) for key, value in expected.items()}
