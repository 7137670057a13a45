"""How the loss benchmark measures: time, peak memory above the inputs, error against float64,
and the machine it ran on.

Peak memory. CUDA: ``torch.cuda.max_memory_allocated()`` minus the allocation before the
run. CPU: the process's resident-set high-water mark (VmHWM, reset through
``/proc/self/clear_refs``) minus the resident set before the run, after ``gc.collect()`` and
``malloc_trim(0)`` have handed freed heap back to the system, so that earlier runs' free
memory cannot hide new allocations. torch's CPU allocator does not cache, so this counts
every page a provider touches, its gradients included (tracemalloc cannot see torch).
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sage_train.environment import cpu_model, package_commit


def _kib(path: str, field: str) -> int:
    """A "field: N kB" line of a /proc file."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path(path).read_text(), re.M).group(1))


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: freed heap may stay resident
        pass


class PeakMemory:
    """Peak bytes allocated between `start()` and `stop()`, on the device of the run."""

    def __init__(self, device: str):
        self.device = device
        self.base = 0

    def start(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        _malloc_trim()
        self.base = _kib("/proc/self/status", "VmRSS") * 1024
        try:
            Path("/proc/self/clear_refs").write_text("5")  # "5" resets VmHWM to the current RSS
        except OSError:
            self.base = None

    def stop(self) -> int | None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        if self.base is None:
            return None
        return max(_kib("/proc/self/status", "VmHWM") * 1024 - self.base, 0)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_runs(
    run: Callable[[], None], reset: Callable[[], None], device: str, *, repeats: int, budget_s: float
) -> dict:
    """Time `run` and measure its peak memory.

    The first full-size run is a warm-up (its compile and lazy set-up were already done on the
    error slice) and is dropped unless the time budget allows only that one run; then up to
    `repeats` timed runs, stopping before one would end past `budget_s`. `reset` (clearing
    gradients) runs before each run, outside the clock and before the memory baseline.
    """
    times, peak = [], 0
    meter = PeakMemory(device)
    begin = time.perf_counter()
    while len(times) < repeats + 1:
        reset()
        meter.start()
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
        used = meter.stop()
        peak = None if used is None or peak is None else max(peak, used)
        if time.perf_counter() - begin + times[-1] > budget_s:
            break
    reset()
    samples = sorted(times[1:] if len(times) > 1 else times)
    ms = {f"ms_p{round(100 * q)}": 1e3 * _quantile(samples, q) for q in (0.5, 0.2, 0.8)}
    return {"runs": len(samples), **ms, "peak_mem_mib": None if peak is None else peak / 2**20}


def _quantile(sorted_values: list, q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    low = int(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def relative_error(actual: torch.Tensor | None, expected: torch.Tensor) -> float | None:
    """max |actual - expected| / max |expected|: the gradient measure of tests/kernels/tolerances.py."""
    if actual is None:
        return None
    expected = expected.double()
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def available_memory(device: str) -> int:
    """Bytes a run may still use on `device`."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    return _kib("/proc/meminfo", "MemAvailable") * 1024


#: the fields `machine` adds to every row.
MACHINE_KEYS = ("cpu", "cores", "threads", "gpu", "torch", "python", "triton", "liger_kernel", "commit")


def machine(device: str) -> dict:
    """What the rows were measured on: processor, threads, accelerator, library versions, commit."""
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    for package in ("triton", "liger_kernel"):
        try:
            from importlib.metadata import version

            info[package] = version(package.replace("_", "-"))
        except Exception:  # not installed: recorded as absent
            info[package] = None
    info["commit"] = package_commit()
    return info
