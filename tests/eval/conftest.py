"""Fixtures of the evaluation tests: the shared math benchmark files and their gold answers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sage_train.tasks.math import BENCHMARKS, MathTask


@pytest.fixture(scope="session")
def math_data() -> Path:
    """../shared/data/math beside the repository (or $SAGE_MATH_DATA)."""
    default = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "math"
    root = Path(os.environ.get("SAGE_MATH_DATA") or default)
    assert root.is_dir(), f"the shared math data is missing: {root}"
    return root


@pytest.fixture(scope="session")
def gold_answers(math_data) -> list[tuple[str, str]]:
    """(benchmark, gold answer) for every problem of every shipped benchmark file."""
    golds = []
    for name, (file, _, _) in BENCHMARKS.items():
        golds += [(name, p.answer) for p in MathTask(str(math_data / file)).problems()]
    return golds
