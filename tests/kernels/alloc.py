"""An allocation recorder: fails if any tensor of `limit` elements or more is created.

Used to prove that a backend never materialises the [N, V] logits (limit N*V/16). It is a
TorchDispatchMode, so it sees every tensor an ATen operator returns, on every device;
memory a Triton kernel or a C++ operator allocates internally through the caching
allocator is invisible to it, so kernels allocate their outputs on the Python side.
`NewStorageRecorder` lists every large tensor a call allocates, to say which transients a backward makes.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AllocationRecorder(TorchDispatchMode):
    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.largest = 0
        self.largest_op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.largest_op = t.numel(), str(func)
        return out

    def check(self) -> None:
        assert self.largest < self.limit, (
            f"a tensor of {self.largest} elements was allocated by {self.largest_op} (limit {self.limit})"
        )


class NewStorageRecorder(TorchDispatchMode):
    """The (operator, shape, dtype) of every tensor an ATen operator returns in storage of its own (not
    a view, not an in-place result) with at least `limit` elements."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.allocated = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.limit and t.untyped_storage().data_ptr() not in inputs:
                self.allocated.append((str(func), tuple(t.shape), t.dtype))
        return out
