"""The Triton backend's tests (sage_kernels/triton; the folder is not named triton so that, with
tests/kernels on sys.path, it can never pass for the triton package where Triton is not installed):
tests/kernels' helpers (parity.py, triton_harness.py, tolerances.py, alloc.py) importable from here,
whatever was collected first."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
