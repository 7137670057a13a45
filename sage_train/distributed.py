"""Processes: ranks and devices, seeds, the host sync of each log interval, stop signals, and the
error that stops a run cleanly."""

from __future__ import annotations

import math
import os
import random
import signal
import socket
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from sage_kernels.metrics import EXTREME_METRICS

from .errors import RunError


def on_rank0(rank: int, action: Callable[[], object], error: type[Exception] = RunError) -> None:
    """`action()` on rank 0 only (a file written once, a lock taken once); its `error` is raised on
    every rank with rank 0's message, so that no rank waits forever at the next collective for one that
    has stopped."""
    message = None
    if rank == 0:
        try:
            action()
        except error as caught:
            message = str(caught)
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared = [message]
        dist.broadcast_object_list(shared, src=0)
        message = shared[0]
    if message:
        raise error(message)


def init_distributed():
    """(rank, world size, device), initialising torch.distributed through DeepSpeed once.

    Launched by torchrun / deepspeed, the environment names the rank; a bare process becomes a
    world of one on a free local port."""
    import deepspeed

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def all_ranks(flag: bool, device: torch.device) -> bool:
    """True when `flag` is true on every rank (a host sync: used where the host decides anyway)."""
    if dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def reduce_rows(pending: list[tuple[int, dict]], device: torch.device) -> list[dict]:
    """Host rows of the pending steps' metrics, averaged over ranks (the loss's `EXTREME_METRICS`: their
    min / max); a rank's NaN (no value: no completion token) is left out, and a value no rank has stays NaN.

    The one host sync of the log interval: every value goes to one tensor, then `.tolist()`."""
    names = sorted(pending[0][1])
    values = torch.stack(
        [
            torch.stack([torch.as_tensor(m[name], dtype=torch.float32, device=device).reshape(()) for name in names])
            for _, m in pending
        ]
    )
    if dist.get_world_size() > 1:
        # NaN is a rank's "no value" (a step without completion tokens): the mean is over the ranks with one
        low = [i for i, name in enumerate(names) if EXTREME_METRICS.get(name) == "min"]
        high = [i for i, name in enumerate(names) if EXTREME_METRICS.get(name) == "max"]
        minimum = values[:, low].nan_to_num(nan=math.inf)
        maximum = values[:, high].nan_to_num(nan=-math.inf)
        counts = (~values.isnan()).float()
        values = values.nan_to_num(nan=0.0)
        for total in (values, counts):
            dist.all_reduce(total)
        dist.all_reduce(minimum, op=dist.ReduceOp.MIN)
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX)
        values = torch.where(counts > 0, values / counts.clamp(min=1.0), math.nan)
        values[:, low] = torch.where(minimum.isinf(), math.nan, minimum)
        values[:, high] = torch.where(maximum.isinf(), math.nan, maximum)
    return [{"step": step, **dict(zip(names, row))} for (step, _), row in zip(pending, values.tolist())]


class InterruptFlag:
    """SIGTERM / SIGINT set a flag (handlers installed only in the main thread); the loop checks it
    at log intervals, agreed over ranks, then checkpoints and stops."""

    def __init__(self) -> None:
        self.is_set = False
        self._previous = {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.is_set = True

    def agreed(self, device: torch.device) -> bool:
        if dist.get_world_size() == 1:
            return self.is_set
        flag = torch.tensor([1.0 if self.is_set else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.is_set = bool(flag.item())
        return self.is_set


def zero3_gathered(params):
    """A context that gathers ZeRO-3 partitioned params (no-op for ordinary tensors)."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return torch.no_grad()
