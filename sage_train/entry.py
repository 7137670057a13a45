"""The console scripts of pyproject.toml: each runs its `cli` function, and a missing optional
dependency ends in one line naming the extra that brings it and the install command, not in a
traceback (``pip install sage-rl`` alone installs the loss, not the trainer's dependencies)."""

from __future__ import annotations

import sys

#: the extra of pyproject.toml that brings each optional top-level module the commands import
TRAIN_MODULES = ("deepspeed", "transformers", "tokenizers", "safetensors", "math_verify", "peft", "yaml", "tqdm")
EXTRA_OF_MODULE = {
    **dict.fromkeys(TRAIN_MODULES + ("matplotlib", "datasets"), "train"),
    "vllm": "vllm",
    "gguf": "real",
    "liger_kernel": "bench",
    "trl": "trl",
}


def _run(command: str, function: str) -> int:
    try:
        from . import cli

        return getattr(cli, function)()
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


def train_main() -> int:
    return _run("sage-train", "train_main")


def eval_main() -> int:
    return _run("sage-eval", "eval_main")


def study_main() -> int:
    return _run("sage-study", "study_main")


def bench_main() -> int:
    return _run("sage-bench", "bench_main")
