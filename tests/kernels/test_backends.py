"""The backend table (`sage_kernels.backends`): every backend provides `Backend`, and its shard sweep
over a whole vocabulary (one shard) gives the float64 reference's lse, logp, entropy and gradients."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from tolerances import assert_close, assert_grad_close

import sage_kernels
from sage_kernels.backends import BACKENDS, Backend, backend_named, resolve_backend
from sage_kernels.reference import logits_of, reference_logprobs_and_entropy

N, D, V = 7, 12, 23


def test_auto_picks_by_device_and_a_bad_name_is_refused_by_name():
    assert resolve_backend("auto", torch.device("cpu")) == "cpu"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="^backend must be 'auto' or one of"):
        resolve_backend("fast", torch.device("cpu"))


@pytest.mark.parametrize("name", BACKENDS)
def test_each_backend_provides_the_protocol(name):
    backend = backend_named(name)
    for member in [m for m in vars(Backend) if not m.startswith("_")] + list(Backend.__annotations__):
        assert hasattr(backend, member), f"{name} lacks {member}"
    assert (torch.float64 in backend.DTYPES) == (name == "reference")


@pytest.mark.parametrize("name", BACKENDS)
def test_shard_stats_over_a_whole_vocabulary_is_the_reference(name):
    torch.manual_seed(0)
    dtype = torch.float32
    hidden, weight, bias = torch.randn(N, D), torch.randn(V, D) / 3, torch.randn(V)
    ids = torch.randint(0, V, (N,))
    d_lse, d_logp, d_entropy = torch.randn(3, N).unbind(0)

    def run(h, w, b, stats):
        h, w, b = (t.detach().clone().requires_grad_(True) for t in (h, w, b))
        lse, logp, entropy = stats(h, w, b)
        torch.autograd.backward(
            (lse, logp, entropy), (d_lse.to(lse.dtype), d_logp.to(lse.dtype), d_entropy.to(lse.dtype))
        )
        return (lse, logp, entropy), (h.grad, w.grad, b.grad)

    def reference(h, w, b):
        logp, entropy = reference_logprobs_and_entropy(h, w, ids, bias=b, temperature=0.7, dtype=torch.float64)
        return torch.logsumexp(logits_of(h, w, b, 0.7, torch.float64), -1), logp, entropy

    expected, expected_grads = run(hidden.double(), weight.double(), bias.double(), reference)
    outputs, grads = run(hidden, weight, bias, lambda h, w, b: backend_named(name).shard_stats(h, w, b, ids, 0.7))
    for what, actual, value in zip(("lse", "logp", "entropy"), outputs, expected):
        assert_close(actual.detach(), value.detach(), dtype, "token", what)
    for what, actual, value in zip(("hidden", "weight", "bias"), grads, expected_grads):
        assert_grad_close(actual, value, dtype, what)


PACKAGE = Path(sage_kernels.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    """The absolute names of the sage_kernels modules `path` imports (relative imports resolved)."""
    package = ["sage_kernels", *path.relative_to(PACKAGE).parent.parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.update(f"{module}.{alias.name}" for alias in node.names)
            names.add(module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_only_the_table_names_a_fast_backend():
    """function.py, the vocabulary-parallel head and the adapters reach the cpu and triton backends
    through `backends.py` alone: no other module outside a backend imports them or imports by name."""
    fast = ("sage_kernels.cpu", "sage_kernels.triton")
    for path in sorted(PACKAGE.rglob("*.py")):
        inside = path.relative_to(PACKAGE).as_posix()
        if inside in ("backends.py", "cpu.py") or inside.startswith("triton/"):
            continue
        imported = _imported_modules(path)
        assert not [name for name in imported if name.startswith(fast)], f"{inside} imports a backend"
        assert "importlib" not in imported, f"{inside} imports by name (importlib)"
