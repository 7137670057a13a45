"""What the Triton backend's tests share: the parity check with backend "triton" fixed, the loss
operators' inputs for a problem (checked, or flat), and an allocation recorder that skips the
interpreter's staging.

A module of its own beside `parity` and `alloc`, which never import Triton: the CPU tests use them without it.
"""

from __future__ import annotations

import parity
import torch
from alloc import AllocationRecorder

from sage_kernels.inputs import validate_inputs
from sage_kernels.triton import boundary
from sage_kernels.triton.tiles import interpreting

_INTERPRETER_STAGING = (torch.ops.aten.set_.source_Storage, torch.ops.aten.copy_.default)


def check_against_reference(problem, config, dtype, *, frozen_weight=False, seed=0):
    """Assert the Triton backend matches the float64 reference on everything it returns."""
    return parity.check_against_reference(
        problem, config, "triton", dtype, frozen=("weight",) if frozen_weight else (), seed=seed
    )


def checked_inputs(problem, config):
    """`problem`'s loss inputs, checked by `validate_inputs` as the loss call checks them (old, reference
    and importance weights included)."""
    return validate_inputs(
        problem["hidden"],
        problem["weight"],
        problem["token_ids"],
        problem["mask"],
        problem["advantages"],
        bias=problem["bias"],
        old_logp=problem["old_logp"],
        ref_logp=problem["ref_logp"],
        is_weights=problem["is_weights"],
        config=config,
    )


def loss_op_args(problem, config):
    """The loss operators' flat arguments for `problem` (hidden and weight as leaves)."""
    floats, ints, num_items = boundary.pack_config(config)
    tensors = boundary.LossTensors(
        hidden=problem["hidden"].reshape(-1, problem["hidden"].shape[-1]).detach().requires_grad_(),
        weight=problem["weight"].detach().requires_grad_(),
        bias=problem["bias"],
        token_ids=problem["token_ids"],
        mask=problem["mask"],
        advantages=problem["advantages"][:, None].expand_as(problem["mask"]).contiguous(),
        old_logp=problem["old_logp"],
        ref_logp=problem["ref_logp"],
        is_weights=None,
        log_q=None,
        sampling_logp=None,
        cells=None,
    )
    return (*tensors.flat(), num_items, floats, ints)


class KernelMemoryRecorder(AllocationRecorder):
    """`AllocationRecorder` that skips the interpreter's byte-level staging of kernel arguments."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if interpreting() and func in _INTERPRETER_STAGING and args[0].dtype == torch.uint8:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)
