"""`sage-bench COMMAND [flags]`: one entry point for the benchmarks, one module per command (the
console script of pyproject.toml; a missing extra is named in one line, as the trainer's commands do)."""

from __future__ import annotations

import importlib
import sys

from sage_train.entry import run_command

#: command -> module with a `main(argv) -> int`
COMMANDS = {"loss": f"{__package__}.loss", "profile": f"{__package__}.profile_stages", "train": f"{__package__}.train"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        print(
            f"usage: sage-bench {{{','.join(COMMANDS)}}} [flags]   (sage-bench loss --help for flags)", file=sys.stderr
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return run_command("sage-bench", lambda: importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
