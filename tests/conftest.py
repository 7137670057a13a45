"""Test-wide settings: Triton's interpreter on CPU-only machines, hypothesis profiles."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is defined: kernels then run through NumPy on the CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "default",
    deadline=None,
    max_examples=25,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
