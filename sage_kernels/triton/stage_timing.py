"""Optional per-stage timing of the Triton paths (`benchmarks/profile_stages.py` turns it on).

The launchers wrap each stage in ``with stage("name"):``. Off (the default) that is a
no-op context; inside `recording()`, CUDA events bracket the stage on the current stream
(no host sync between stages, so the stages still overlap their launches as in a normal
run), and on CPU the wall clock does. Times of a stage that runs once per chunk add up.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

_recorder: StageRecorder | None = None


class StageRecorder:
    """Per-stage elapsed time of everything run while it is recording."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events = defaultdict(list)
        self._seconds = defaultdict(float)
        self.order: list[str] = []

    @contextlib.contextmanager
    def __call__(self, name: str):
        if name not in self.order:
            self.order.append(name)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[name].append((start, end))
        else:
            begin = time.perf_counter()
            yield
            self._seconds[name] += time.perf_counter() - begin

    def milliseconds(self) -> dict:
        """{stage: total ms} in the order the stages first ran (synchronises on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
            return {name: sum(s.elapsed_time(e) for s, e in self._events[name]) for name in self.order}
        return {name: 1e3 * self._seconds[name] for name in self.order}


def stage(name: str):
    """A context timing stage `name` when a recorder is on; a no-op otherwise."""
    return contextlib.nullcontext() if _recorder is None else _recorder(name)


@contextlib.contextmanager
def recording(device: torch.device):
    """Record the stages of everything run inside; yields the `StageRecorder`."""
    global _recorder
    previous, _recorder = _recorder, StageRecorder(torch.device(device))
    try:
        yield _recorder
    finally:
        _recorder = previous
