"""Tolerances per dtype, in one place: how close a backend must be to the float64 reference.

Keys are the dtype of `hidden`/`weight`. `loss` and `token` (per-token logp, entropy, kl, ...)
are compared with (atol, rtol); gradients are compared by the relative error
max|g - g64| / max(max|g64|, tiny) against `grad`. The low-precision rows are set from
what PyTorch itself achieves at that dtype against float64 (a matmul of bf16 inputs with
an fp32 accumulator), not loosened to make a kernel pass.
"""

import torch

TOLERANCES = {
    torch.float64: {"loss": (1e-10, 1e-10), "token": (1e-10, 1e-10), "grad": 1e-10},
    torch.float32: {"loss": (1e-5, 1e-5), "token": (1e-4, 1e-5), "grad": 1e-4},
    torch.bfloat16: {"loss": (2e-2, 2e-2), "token": (5e-2, 2e-2), "grad": 3e-2},
    torch.float16: {"loss": (5e-3, 5e-3), "token": (1e-2, 5e-3), "grad": 5e-3},
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, kind: str, what: str = ""):
    """`actual` against the float64 `expected` with the tolerance of `kind` for `dtype`."""
    atol, rtol = TOLERANCES[dtype][kind]
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what} ({dtype}, {kind}): {m}"
    )


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = ""):
    """Relative max-norm error of a gradient against the float64 one."""
    expected = expected.double()
    scale = expected.abs().max().clamp(min=1e-30)
    err = ((actual.double() - expected).abs().max() / scale).item()
    assert err <= TOLERANCES[dtype]["grad"], f"{what} ({dtype}): relative gradient error {err:.3g}"
