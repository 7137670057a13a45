"""The Triton backend's tests: tests/kernels' helpers (parity.py, triton_harness.py, tolerances.py, alloc.py)
importable from here, whatever was collected first."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
