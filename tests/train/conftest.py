"""Fixtures for the trainer tests: a tiny, fast run config, a world of one process, the math data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from run_copies import TINY_RUN

from sage_train.config import build, resolve
from sage_train.models import loading
from sage_train.tasks.math import BENCHMARKS, MathTask, data_root


@pytest.fixture
def tiny_run():
    """The keys of a seconds-long run, as a YAML-ready mapping."""
    return dict(TINY_RUN)


@pytest.fixture
def tiny_config(tmp_path):
    """tiny_config(**overrides) -> a resolved TrainConfig writing under tmp_path."""

    def make(**overrides):
        return resolve(build({**TINY_RUN, "output_dir": str(tmp_path / "runs"), **overrides}))

    return make


@pytest.fixture(scope="session")
def distributed():
    """torch.distributed initialised as a world of one (gloo), as `sage-train` does without a launcher."""
    from sage_train.distributed import init_distributed

    return init_distributed()


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """Tiny models run fastest on one thread (many threads on a shared 2-core machine crawl);
    the thread count is restored after each test, as `train` sets it process-wide."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def math_data() -> Path:
    """The math benchmark files the package ships (or $SAGE_MATH_DATA when set)."""
    root = data_root()
    if not all((root / file).is_file() for file, _, _ in BENCHMARKS.values()):
        pytest.skip(f"the math benchmark files are not in {root}")
    return root


@pytest.fixture(scope="session")
def gold_answers(math_data) -> list[tuple[str, str]]:
    """(benchmark, gold answer) for every problem of every shipped benchmark file."""
    golds = []
    for name, (file, _, _) in BENCHMARKS.items():
        golds += [(name, p.answer) for p in MathTask(str(math_data / file)).problems()]
    return golds


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A model cache of the test's own (`sage_train.models.packaged`)."""
    monkeypatch.setenv(loading.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def gguf_path(tmp_path_factory):
    """The tiny SmolLM2-layout GGUF file (tiny_gguf.py), written once."""
    from tiny_gguf import write_tiny_gguf  # the gguf package is in the [dev] extra

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path
