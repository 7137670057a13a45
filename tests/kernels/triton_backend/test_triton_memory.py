"""The Triton backend never allocates a tensor of N*V/16 elements or more (no [N, V] logits).

The forward and backward passes run under `alloc.AllocationRecorder`. They are called
through `ops.loss_forward` / `ops.loss_backward` (the bodies of the torch.library
operators), because a dispatch mode sees a custom operator only as one call: inside it
the mode is off. The shape keeps the gradients themselves ([V, D] and [N, D]) under the
limit, which needs D < N/16 and D < V/16. The same recorder catches the reference's
materialised logits, so the limit is one a logits-building backend fails.

Under TRITON_INTERPRET=1 the interpreter stages the storage of every kernel argument
through a byte tensor (``aten.set_.source_Storage`` and ``aten.copy_`` on uint8, the
whole weight included) to emulate device memory; those copies do not exist on a GPU and
are not counted.

A backward allocates nothing of the weight's or hidden's size besides the gradients themselves
(`test_backward_allocates_no_gradient_sized_zeros`, seen from outside the operators).
"""

from __future__ import annotations

import pytest
import torch
from alloc import NewStorageRecorder
from parity import DEVICE, make_problem
from triton_harness import KernelMemoryRecorder, checked_inputs

from sage_kernels import LossConfig, fused_linear_sage_loss, logprobs_and_entropy
from sage_kernels.triton import boundary, ops, tiles

B, L, V, D = 4, 128, 1024, 24
LIMIT = B * L * V // 16


@pytest.fixture(autouse=True)
def narrow_vocab_tiles(monkeypatch):
    """BLOCK_V = 32: a backward chunk is at least one vocab tile, so the bound needs V >= 32 BLOCK_V
    (true at real vocabularies); a small BLOCK_V keeps this test's V small for the interpreter."""
    monkeypatch.setitem(tiles.TILE_OVERRIDE, "block_v", 32)
    monkeypatch.setitem(tiles.TILE_OVERRIDE, "block_n", 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_and_backward_stay_under_the_limit(dtype):
    problem = make_problem(B=B, L=L, V=V, D=D, dtype=dtype, mask="tail", is_weights=True)
    config = LossConfig(entropy_coef=0.01, top_entropy_quantile=0.5, importance_sampling="sequence")
    inputs = checked_inputs(problem, config)
    with KernelMemoryRecorder(LIMIT) as recorder:
        tensors = boundary.LossTensors.of(inputs)
        out = ops.loss_forward(tensors, config)
        flags = boundary.BackwardFlags.of(config, need_hidden=True, need_weight=True, need_bias=True)
        grads = ops.loss_backward(torch.tensor(1.5, device=DEVICE), boundary.TwoPassSaved.of(tensors, out), flags)
    recorder.check()
    assert recorder.largest > 0
    assert all(torch.isfinite(grad).all() for grad in grads)


def test_scoring_stays_under_the_limit():
    problem = make_problem(B=B, L=L, V=V, D=D, old=False, ref=False)
    with KernelMemoryRecorder(LIMIT) as recorder:
        logp, _ = logprobs_and_entropy(
            problem["hidden"], problem["weight"], problem["token_ids"], bias=problem["bias"], backend="triton"
        )
    recorder.check()
    assert torch.isfinite(logp).all()


def test_the_recorder_catches_materialised_logits():
    problem = make_problem(B=2, L=L, V=V, D=D, old=False, ref=False)
    with KernelMemoryRecorder(2 * L * V // 16) as recorder:
        fused_linear_sage_loss(config=LossConfig(beta=0.0), backend="reference", **problem)
    with pytest.raises(AssertionError, match="elements was allocated"):
        recorder.check()


@pytest.mark.parametrize("options", [{}, {"importance_sampling": "sequence"}], ids=["three-matmul", "two-pass"])
def test_backward_allocates_no_gradient_sized_zeros(options):
    # autograd fills every operator output that gets no gradient with zeros unless told not to: the
    # three-matmul operator returns its gradients as outputs, so that would be a [V, D] and an [N, D]
    # tensor of zeros per backward on top of the gradients themselves
    b, length, v, d = 2, 9, 96, 40
    problem = make_problem(B=b, L=length, V=v, D=d, seed=3, mask="tail")
    leaves = {k: problem[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    rest = {k: t for k, t in problem.items() if k not in leaves}
    loss = fused_linear_sage_loss(**leaves, **rest, config=LossConfig(**options), backend="triton").loss
    with NewStorageRecorder(min(b * length * d, v * d)) as recorder:
        loss.backward()
    # the two-pass backward computes the gradients there, in its operator: exactly those, once each
    expected = []
    if options:
        op = "sage_kernels.triton_sage_loss_backward.default"
        expected = [(op, (b * length, d)), (op, (v, d))]
    assert sorted((op, shape) for op, shape, _ in recorder.allocated) == expected
    assert all(leaves[k].grad is not None and torch.isfinite(leaves[k].grad).all() for k in leaves)
