"""The backend table: every backend by name, and what each one provides (`Backend`).

`function.py` (the loss and scoring entry points), the vocabulary-parallel head
(`vocab_parallel.py`) and, through them, the adapters read this table alone; no other module names
a backend. Each backend is a module that satisfies `Backend`, imported on first use (the triton
backend imports triton):

- ``"reference"``: `reference.py`, materialises the logits (the float64 oracle).
- ``"cpu"``: `cpu.py`, the native csrc operator, or chunked PyTorch without a compiler.
- ``"triton"``: `triton/`, the fused GPU kernels (CPU tensors too under TRITON_INTERPRET=1).
- ``"auto"``: ``"triton"`` for CUDA tensors, ``"cpu"`` otherwise.

Every backend runs every `LossConfig`: which of its paths a call takes is the backend's own choice
(the triton backend's three-matmul path where `three_matmul.exact_for`); the dtypes differ.
Adding a backend: a module with the four names of `Backend`, a row here, and the parity tests
against the reference (tests/kernels/parity.py).
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from .inputs import SageInputs, SageLossOutput
from .spec import LossConfig


class Backend(Protocol):
    """What a backend module provides. `DTYPES`: the floating dtypes it takes for hidden and weight."""

    DTYPES: tuple[torch.dtype, ...]

    def sage_loss(self, inputs: SageInputs, config: LossConfig) -> SageLossOutput:
        """The loss of validated `inputs` (docs/loss.md), differentiable in hidden, weight and bias."""

    def logprobs_and_entropy(
        self, hidden2d, weight, token_ids_flat, bias, temperature, logit_scale=1.0, logit_softcap=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logp and entropy [N] of every row of `hidden2d` [N, D], without gradient."""

    def shard_stats(self, hidden2d, weight, bias, token_ids, temperature: float):
        """(lse, logp, entropy) [n] of each row over one vocabulary shard `weight` [V_r, D] (local
        `token_ids`), differentiable in hidden2d, weight and bias (`shard_sweep.py` derives it)."""


#: each backend's module, relative to this package.
BACKEND_MODULES = {"reference": ".reference", "cpu": ".cpu", "triton": ".triton"}
BACKENDS = tuple(BACKEND_MODULES)
#: the names a caller may ask for: a backend, or "auto" (`resolve_backend` picks by device)
BACKEND_CHOICES = ("auto", *BACKENDS)


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend name for `backend` ("auto" picks by device)."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {list(BACKENDS)}, got {backend!r}")
    return backend


def device_of(hidden) -> torch.device:
    """The device a call runs on (CPU for what is not yet a tensor: validation names it)."""
    return hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")


def backend_named(name: str) -> Backend:
    """The backend module of a concrete name (`resolve_backend`'s answer)."""
    return importlib.import_module(BACKEND_MODULES[name], __package__)
