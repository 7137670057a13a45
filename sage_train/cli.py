"""Console entry points: `sage-train`, `sage-eval` and `sage-study` (`sage-bench` is `sage_bench.cli`).

Each parses its arguments, exits 2 with one line naming what is wrong on bad input, and hands
the work to the module that owns it (`run.train`, `eval.command.main`, `study.grid.main`).
"""

from __future__ import annotations

import os
import sys

from .config import DEFAULT_CONFIG, parse_args
from .config_files import packaged_config_names
from .errors import ConfigError, RunError


def train_main(argv=None) -> int:
    """`sage-train [--config FILE] [--key=value ...] [--dry-run]`; returns the exit status.
    ``--dry-run`` prints the fully resolved config as YAML and exits without loading a model."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in argv):
        print(train_usage())
        return 0
    dry_run = any(arg in ("--dry-run", "--dry_run") for arg in argv)
    try:
        cfg = parse_args([arg for arg in argv if arg not in ("--dry-run", "--dry_run")])
    except ConfigError as error:
        print(f"sage-train: {error}")
        return 2
    if dry_run:
        from .config_files import dump

        print(dump(cfg.to_dict()), end="")
        return 0
    from .run import train

    try:
        summary = train(cfg)
    except (ConfigError, RunError) as error:  # ConfigError: found once the run knows its world and directory
        if os.environ.get("RANK", "0") == "0":  # every rank raises the same error; one says it
            print(f"sage-train: {error}", flush=True)
        return 2 if isinstance(error, ConfigError) else 1  # RunError: stopped cleanly, the message says what is kept
    # 130: stopped by a signal after its checkpoint was written (a scheduler should not read it as done).
    return 130 if summary.get("interrupted") else 0


def train_usage() -> str:
    """The command line, then every config key with its default (the packaged default config's values)."""
    defaults = parse_args([])
    keys = "\n".join(f"  --{key}={value!r}" for key, value in defaults.to_dict().items())
    return (
        f"usage: sage-train [--config FILE_OR_PACKAGED_NAME] [--key=value ...] [--dry-run]\n"
        f"--dry-run prints the resolved config as YAML and exits without loading a model\n"
        f"packaged configs: {', '.join(packaged_config_names())} (default: {DEFAULT_CONFIG})\n"
        f"keys, with the default run's values:\n{keys}"
    )


def eval_main(argv=None) -> int:
    """`sage-eval --model PATH_OR_RUN_DIR ... --tasks ...`; returns the exit status."""
    from .eval.command import main

    try:
        return main(sys.argv[1:] if argv is None else argv)
    except (ValueError, FileNotFoundError, ConfigError) as error:
        print(f"sage-eval: {error}", file=sys.stderr)
        return 2
    except RunError as error:  # its outputs could not be written (a full disk); the records are kept
        print(f"sage-eval: {error}", file=sys.stderr)
        return 1


def study_main(argv=None) -> int:
    """`sage-study --algorithms ... --seeds ... --out DIR` (see `sage_train.study`); returns the exit status."""
    from .study.design import StudyError
    from .study.grid import main

    try:
        return main(sys.argv[1:] if argv is None else argv)
    except StudyError as error:
        print(f"sage-study: {error}", file=sys.stderr)
        return 2
