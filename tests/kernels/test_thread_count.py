"""The CPU backend gives the same bits for 1, 2 and 4 threads, on every instruction-set path.

Each thread count runs in its own process (``OMP_NUM_THREADS``, so the BLAS and ATen pools
start with it), on shapes where the native operator's products have several tiles (V above
512, D above 256, non-dividing tails), where blocks are tall (N = 512 and 2048: d(hidden)'s
inner dimension V is long, the product MKL's AVX-512 kernels split by thread count), where the
per-token stage reduces more elements than ATen keeps on one thread (N above 32768, one long
row), with a bias, and for loss types of both sweeps (token-local: grpo, dapo; two sweeps:
vespo, the sequence ratio). Every output is hashed: loss, logp, entropy, metrics, and the
hidden, weight and bias gradients.

The processes run once per CPU capability this machine can be forced to: torch's own
(AVX512 or AVX2) and, below AVX512, AVX2 (``ATEN_CPU_CAPABILITY`` for ATen and the native
operator's build, ``MKL_ENABLE_INSTRUCTIONS`` for MKL's kernels), so that an AVX-512 machine
also checks the AVX2 path; an AVX2-only machine cannot be raised to AVX-512 and says so.
Where torch's BLAS is MKL, a second check reads MKL's own log: every product the operator
makes is planned for one thread, whatever the thread count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sage_kernels.ordered import SERIAL_ELEMENTS, ordered_sum

#: (B, L, D, V, loss options): each exercises a different split of the work
CASES = {
    "tiles-bias-grpo": (3, 37, 300, 1100, dict(loss_type="grpo")),
    "tiles-bias-vespo": (3, 37, 300, 1100, dict(loss_type="vespo")),
    "tall-blocks-grpo": (1, 512, 300, 1100, dict(loss_type="grpo")),
    "tall-blocks-long-vocab": (2, 1024, 64, 4096, dict(loss_type="dapo")),
    "long-row-dapo": (1, 40000, 8, 40, dict(loss_type="dapo")),
    "many-rows-sequence": (48, 1024, 16, 600, dict(loss_type="grpo", importance_sampling="sequence")),
}

#: torch's CPU capability -> the capabilities a process can be forced down to on such a machine
_CAPABILITIES_BELOW = {"AVX512": ["AVX512", "AVX2"], "AVX2": ["AVX2"]}
#: what forces a capability: ATen's dispatch (and so the native operator's build flags) and MKL's kernels
_FORCE = {
    "AVX512": {},
    "AVX2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}

_PROGRAM = r"""
import hashlib, json, sys
import torch
from sage_kernels import fused_linear_sage_loss, logprobs_and_entropy
from sage_kernels import cpu

torch.set_num_threads(int(sys.argv[2]))  # also above the core count, which OMP_NUM_THREADS alone is not
assert torch.backends.cpu.get_cpu_capability() == sys.argv[3], torch.backends.cpu.get_cpu_capability()
assert cpu.native_ops() is not None, "the native operator did not build"
cases = json.loads(sys.argv[1])
digests = {}
for name, (B, L, D, V, options) in cases.items():
    g = torch.Generator().manual_seed(B * L + V)
    hidden = torch.randn(B, L, D, generator=g).requires_grad_()
    weight = (torch.randn(V, D, generator=g) / D**0.5 * 3).requires_grad_()
    bias = torch.randn(V, generator=g).requires_grad_()
    ids = torch.randint(0, V, (B, L), generator=g)
    mask = torch.rand(B, L, generator=g) > 0.2
    advantages = torch.randn(B, generator=g)
    ref_logp = torch.randn(B, L, generator=g).clamp(max=0) - 1
    old_logp = ref_logp + 0.1 * torch.randn(B, L, generator=g)
    out = fused_linear_sage_loss(hidden, weight, ids, mask, advantages, bias=bias, ref_logp=ref_logp,
                                 old_logp=old_logp, backend="cpu", **options)
    (out.loss * 1.7).backward()
    logp, entropy = logprobs_and_entropy(hidden.detach(), weight.detach(), ids, bias=bias.detach(), backend="cpu")
    digest = hashlib.sha256()
    for t in (out.loss, out.logp, out.entropy, *out.metrics.values(), hidden.grad, weight.grad, bias.grad, logp,
              entropy):
        digest.update(t.detach().float().contiguous().numpy().tobytes())
    digests[name] = digest.hexdigest()
print(json.dumps({"threads": torch.get_num_threads(), "digests": digests}))
"""


def _capabilities() -> list:
    return _CAPABILITIES_BELOW.get(torch.backends.cpu.get_cpu_capability(), [])


def _env(threads: int, capability: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **_FORCE[capability]}


def _digests(threads: int, capability: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _PROGRAM, json.dumps(CASES), str(threads), capability],
        env=_env(threads, capability),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["threads"] == threads
    return report["digests"]


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["AVX512", "AVX2"])
def test_same_bits_for_one_two_and_four_threads(capability):
    if capability not in _capabilities():
        pytest.skip(f"torch cannot run the {capability} path on this CPU ({torch.backends.cpu.get_cpu_capability()})")
    one, two, four = (_digests(threads, capability) for threads in (1, 2, 4))
    assert len(set(one.values())) == len(CASES)  # each case hashed its own values
    for name in CASES:
        assert one[name] == two[name] == four[name], f"{name} ({capability}): the result depends on the thread count"


_MKL_PROGRAM = r"""
import torch
from sage_kernels import cpu
torch.set_num_threads(2)
ops = cpu.native_ops()
assert ops is not None, "the native operator did not build"
rows, D, V = 64, 300, 1100
g = torch.Generator().manual_seed(0)
hidden, weight = torch.randn(rows, D, generator=g), torch.randn(V, D, generator=g) / 10
targets = torch.randint(0, V, (rows,), generator=g)
logits = torch.empty(rows, V)
logp, entropy, lse = torch.empty(rows), torch.empty(rows), torch.empty(rows)
print("MARK-BEGIN", flush=True)
ops.block_stats(hidden, weight, None, targets, 1.0, 1.0, False, logits, logp, entropy, lse)
ops.block_grad(logits, targets, lse, entropy, torch.ones(rows), torch.ones(rows), 1.0, 1.0, False, hidden, weight,
               torch.empty(rows, D), torch.zeros(V, D), None)
print("MARK-END", flush=True)
"""


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch's BLAS here is not MKL")
@pytest.mark.parametrize("capability", ["AVX512", "AVX2"])
def test_every_product_is_planned_for_one_thread(capability):
    """MKL's log (MKL_VERBOSE) names each call's planned thread count: 1 inside the operator at 2 threads."""
    if capability not in _capabilities():
        pytest.skip(f"torch cannot run the {capability} path on this CPU ({torch.backends.cpu.get_cpu_capability()})")
    env = {**_env(2, capability), "MKL_VERBOSE": "1"}
    result = subprocess.run([sys.executable, "-c", _MKL_PROGRAM], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout.split("MARK-BEGIN", 1)[1].split("MARK-END", 1)[0]
    calls = [line for line in log.splitlines() if "GEMM(" in line]
    # logits: 3 tiles of V; d(hidden): 2 tiles of D; d(weight): 3 tiles of V
    assert len(calls) == 8, log[-2000:]
    planned = [line.rsplit("NThr:", 1)[1].split()[0] for line in calls]
    assert planned == ["1"] * len(calls), calls


def test_ordered_sum_is_sum_below_the_serial_size_and_close_above():
    g = torch.Generator().manual_seed(0)
    small = torch.randn(7, SERIAL_ELEMENTS // 7 - 1, generator=g)
    assert torch.equal(ordered_sum(small), small.sum())
    assert torch.equal(ordered_sum(small, -1, keepdim=True), small.sum(-1, keepdim=True))
    for shape in [(SERIAL_ELEMENTS * 3 + 5,), (1, 100_003), (3, 50_000), (40_000, 2)]:
        x = torch.randn(*shape, generator=g)
        torch.testing.assert_close(ordered_sum(x).double(), x.double().sum(), atol=1e-3, rtol=1e-6)
        torch.testing.assert_close(ordered_sum(x, -1).double(), x.double().sum(-1), atol=1e-3, rtol=1e-6)
    grad = torch.randn(2, 70_000, generator=g).requires_grad_()
    ordered_sum(grad, -1).sum().backward()
    assert torch.equal(grad.grad, torch.ones_like(grad))


def test_ordered_sum_refuses_another_dimension():
    with pytest.raises(ValueError, match="dim"):
        ordered_sum(torch.ones(2, 3), 0)
