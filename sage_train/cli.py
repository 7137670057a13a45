"""Console entry points: `sage-train`, `sage-eval`, `sage-study` and `sage-bench`.

Each parses its arguments, exits 2 with one line naming what is wrong on bad input, and hands
the work to the module that owns it (`run.train`, `eval_command.run`, `study.main`, `sage_bench.cli`).
"""

from __future__ import annotations

import sys

from .config import DEFAULT_CONFIG, ConfigError, packaged_config_names, parse_args


def train_main(argv=None) -> int:
    """`sage-train [--config FILE] [--key=value ...]`; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in argv):
        print(train_usage())
        return 0
    try:
        cfg = parse_args(argv)
    except ConfigError as error:
        print(f"sage-train: {error}")
        return 2
    from .run import train

    summary = train(cfg)
    if summary is None:
        return 1
    # 130: stopped by a signal after its checkpoint was written (a scheduler should not read it as done).
    return 130 if summary.get("interrupted") else 0


def train_usage() -> str:
    """The command line, then every config key with its default (the packaged default config's values)."""
    defaults = parse_args([])
    keys = "\n".join(f"  --{key}={value!r}" for key, value in defaults.to_dict().items())
    return (
        f"usage: sage-train [--config FILE_OR_PACKAGED_NAME] [--key=value ...]\n"
        f"packaged configs: {', '.join(packaged_config_names())} (default: {DEFAULT_CONFIG})\n"
        f"keys, with the default run's values:\n{keys}"
    )


def eval_main(argv=None) -> int:
    """`sage-eval --model PATH_OR_RUN_DIR ... --tasks ...`; returns the exit status."""
    from .eval_command import main

    try:
        return main(sys.argv[1:] if argv is None else argv)
    except (ValueError, FileNotFoundError, ConfigError) as error:
        print(f"sage-eval: {error}", file=sys.stderr)
        return 2


def study_main(argv=None) -> int:
    """`sage-study --algorithms ... --seeds ... --out DIR` (see `sage_train.study`); returns the exit status."""
    from .study import StudyError, main

    try:
        return main(sys.argv[1:] if argv is None else argv)
    except StudyError as error:
        print(f"sage-study: {error}", file=sys.stderr)
        return 2


def bench_main(argv=None) -> int:
    """`sage-bench loss ...`."""
    from sage_bench.cli import main

    return main(sys.argv[1:] if argv is None else argv)
