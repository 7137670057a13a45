"""Test-wide settings: Triton's interpreter on CPU-only machines, hypothesis profiles.

Profiles (HYPOTHESIS_PROFILE): "default" (25 examples, derandomized), "thorough" (300), and "device"
(benchmarks/run_device.sh on a lent GPU, whose window is minutes: the default's, with 3 examples). A test's
own @settings(max_examples=...) overrides a profile's, so under "device" it is capped at the profile's
count here: each example of a Triton test may compile a kernel variant, seconds on a cold machine.
"""

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
settings.register_profile("device", settings.get_profile("default"), max_examples=3)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
settings.load_profile(PROFILE)


def pytest_collection_modifyitems(items):
    if PROFILE != "device":
        return
    cap = settings.get_profile("device").max_examples
    for item in items:
        test = getattr(item, "obj", None)
        own = getattr(test, "_hypothesis_internal_use_settings", None)  # what @given runs with
        if own is not None and own.max_examples > cap:
            test._hypothesis_internal_use_settings = settings(own, max_examples=cap)
