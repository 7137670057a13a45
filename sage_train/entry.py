"""The trainer's console scripts of pyproject.toml: each runs its `cli` function through `run_command`,
where a missing optional dependency ends in one line naming the extra that brings it and the install
command, not in a traceback (``pip install sage-rl`` alone installs the loss, not the trainer's
dependencies). ``sage-bench`` (`sage_bench.cli`) goes through `run_command` too."""

from __future__ import annotations

import sys
from collections.abc import Callable

#: the extra of pyproject.toml that brings each optional top-level module the commands import
TRAIN_MODULES = ("deepspeed", "transformers", "tokenizers", "safetensors", "math_verify", "peft", "yaml", "tqdm")
EXTRA_OF_MODULE = {
    **dict.fromkeys(TRAIN_MODULES + ("matplotlib", "datasets"), "train"),
    "vllm": "vllm",
    "gguf": "real",
    "liger_kernel": "bench",
    "trl": "trl",
}


def run_command(command: str, main: Callable[[], int]) -> int:
    """`main()`'s exit status; 1 with one line on stderr when a module of an extra is missing."""
    try:
        return main()
    except ModuleNotFoundError as error:
        extra = EXTRA_OF_MODULE.get((error.name or "").split(".")[0])
        if extra is None:
            raise
        print(
            f"{command}: needs the '{extra}' extra (no module named {error.name!r}): "
            f"pip install 'sage-rl[{extra}]' (README: Installing with pip)",
            file=sys.stderr,
        )
        return 1


def _run(command: str, function: str) -> int:
    def main() -> int:
        from . import cli  # inside run_command: importing it may need an extra

        return getattr(cli, function)()

    return run_command(command, main)


def train_main() -> int:
    return _run("sage-train", "train_main")


def eval_main() -> int:
    return _run("sage-eval", "eval_main")


def study_main() -> int:
    return _run("sage-study", "study_main")
