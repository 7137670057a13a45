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


def kernel_signature():
    """(the jit function's parameter names, the Python function's signature, the heuristics' flags)."""
    heuristics = token_stage._token_stage_kernel
    jit = heuristics.fn  # a JITFunction, or an InterpretedFunction under TRITON_INTERPRET=1
    return list(jit.arg_names), inspect.signature(jit.fn), list(heuristics.values)


def test_the_table_names_the_kernels_parameters_in_order():
    arg_names, signature, flags = kernel_signature()
    table = [option.name for option in TOKEN_STAGE_OPTIONS]
    assert len(set(table)) == len(table)
    # the tensors, the sizes, the table's options, the flags the heuristics read from the tensors, and
    # the layout of the row statistics and of a chunk
    sizes = arg_names.index("B")
    assert all(name.endswith("_ptr") for name in arg_names[:sizes])
    assert arg_names[sizes:] == ["B", "L"] + table + flags + ["COLUMNS", "BLOCK_L"]
    assert list(signature.parameters) == arg_names
    kinds = {name: "constexpr" in str(param.annotation) for name, param in signature.parameters.items()}
    assert [kinds[option.name] for option in TOKEN_STAGE_OPTIONS] == [
        option.constexpr for option in TOKEN_STAGE_OPTIONS
    ]
    assert not any(kinds[name] for name in arg_names[: sizes + 2])
    assert all(kinds[name] for name in flags + ["COLUMNS", "BLOCK_L"])


def hand_written_launch(c: LossConfig) -> dict:
    """The options token_stage's launch passed before the table, as it spelled them: the scalars by
    position (the kernel's parameters after B and L, named here from the kernel's signature), then the
    constexprs by name."""
    arg_names, _, _ = kernel_signature()
    scalars = (
        c.beta,
        c.gamma,
        c.tau,
        c.q_min,
        c.q_max,
        c.eps_low,
        c.eps_high,
        c.delta_clip or 0.0,
        c.dual_clip_c or 0.0,
        c.entropy_coef,
        c.sapo_temperature_pos,
        c.sapo_temperature_neg,
        c.vespo_k_pos,
        c.vespo_lambda_pos,
        c.vespo_k_neg,
        c.vespo_lambda_neg,
        c.kl_clamp or 0.0,
        c.off_policy_mask_threshold or 0.0,
        c.dppo_ratio_cap,
    )
    first = arg_names.index("L") + 1
    return dict(
        zip(arg_names[first : first + len(scalars)], (float(x) for x in scalars)),
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


#: every scalar a different number, every optional one given, every flag off its default: a row reading
#: a neighbour's field or the wrong flag shows
EVERY_OPTION = dict(loss_type="dapo", beta=0.07, kl="fk3", guide="none", importance_sampling="sequence")
EVERY_OPTION.update(gamma=0.11, tau=1.3, q_min=0.55, q_max=1.45, eps_low=0.21, eps_high=0.28, entropy_coef=0.013)
EVERY_OPTION.update(delta_clip=3.5, dual_clip_c=2.5, kl_clamp=17.0, off_policy_mask_threshold=0.45)
EVERY_OPTION.update(sapo_temperature_pos=0.9, sapo_temperature_neg=1.15, use_bias_correction_kl=True)
EVERY_OPTION.update(vespo_k_pos=2.2, vespo_lambda_pos=3.3, vespo_k_neg=3.4, vespo_lambda_neg=2.1)
EVERY_OPTION.update(dppo_ratio_cap=6)  # an int: the kernel still gets a float

CONFIGS = {
    "default": {},
    "every option": EVERY_OPTION,
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
