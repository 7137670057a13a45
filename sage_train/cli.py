"""Console entry points. Each forwards to the module that owns the command."""

from __future__ import annotations

import sys


def train_main(argv=None) -> int:
    """`sage-train [--config FILE] [--key=value ...]`."""
    from .trainer import main
    return main(sys.argv[1:] if argv is None else argv)


def eval_main(argv=None) -> int:
    """`sage-eval --model PATH_OR_RUN_DIR ... --tasks ...`."""
    from .evaluate import main
    return main(sys.argv[1:] if argv is None else argv)


def bench_main(argv=None) -> int:
    """`sage-bench loss ...`."""
    from benchmarks.cli import main
    return main(sys.argv[1:] if argv is None else argv)
