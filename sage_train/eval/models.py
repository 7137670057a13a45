"""`sage-eval`'s models: which folder each --model names (a run directory, an HF directory, a hub
name), checked before anything is written (`models.files.check_model`); the run config it was trained
with; its fingerprint, which keys its records (`eval_records`), so that the samples of a retrained
model are never mixed with the old ones; the engine that samples it, and its prompts: in its chat
format, and no longer than --max-prompt-tokens (a 30 MB problem line must not reach the model)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from .. import config_files
from ..models.files import check_model, fingerprint
from ..models.loading import gguf_source, model_directory
from ..rollout.base import RolloutEngine
from ..run_files import RUN_FILES

#: prompts longer than this many bytes per allowed token are refused without tokenizing them (no
#: tokenizer packs that much text into its tokens on average)
MAX_BYTES_PER_TOKEN = 64


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model to evaluate: its label (plots, tables, records), HF directory, and run config."""

    label: str
    path: str
    run_config: dict | None


def resolve_models(paths: Sequence[str]) -> list[ModelSpec]:
    """Run directories (`config.yaml` + `final/`) load `<run>/final`; anything else is an HF
    directory or hub name. Labels are the run or directory names, full paths if those clash."""
    resolved = []
    for given in paths:
        path = Path(given)
        if (path / RUN_FILES.config).is_file() and (path / RUN_FILES.final).is_dir():
            config = _run_config(path / RUN_FILES.config)
            resolved.append((path.resolve().name, str(path / RUN_FILES.final), config))
        elif (path / RUN_FILES.config).is_file() and not (path / "config.json").is_file():
            raise ValueError(
                f"--model {given!r} is a run directory without a final model ({path / RUN_FILES.final}); "
                "did the run finish?"
            )
        elif gguf_source(given) is not None:  # a named model or a GGUF file: its cached HF conversion
            resolved.append((Path(given).stem if given.endswith(".gguf") else given, model_directory(given), None))
        elif path.exists() and not path.is_dir():
            raise ValueError(f"--model {given!r}: expected a run directory, an HF model directory or a hub name")
        else:
            name = path.resolve().name if path.is_dir() else given
            if name == RUN_FILES.final and path.is_dir():  # runs/<name>/final: call it by the run's name
                name = path.resolve().parent.name
            resolved.append((name, given, None))
    labels = [label for label, _, _ in resolved]
    if len(set(labels)) < len(labels):
        resolved = [(path, path, config) for _, path, config in resolved]
    if len({label for label, _, _ in resolved}) < len(resolved):
        raise ValueError(f"--model given twice: {list(paths)}")
    return [ModelSpec(*entry) for entry in resolved]


def trained_config(model: ModelSpec) -> dict:
    """The run config a model was trained with: its run directory's, or for ``<run>/final`` the
    config.yaml beside it; {} when there is none."""
    if model.run_config is not None:
        return model.run_config
    beside = Path(model.path).parent / RUN_FILES.config
    if Path(model.path).is_dir() and beside.is_file():
        return _run_config(beside)
    return {}


def build_engine(kind: str, model_path: str, device: str) -> RolloutEngine:
    """A rollout engine sampling from the model at `model_path`: "hf" loads it with transformers
    on `device`; "vllm" hands the path to a vLLM engine that owns the GPU (no sleep mode: there is
    no training to share memory with)."""
    from ..rollout.base import make_engine

    if kind == "hf":
        from ..models.loading import load_pretrained

        model, tokenizer = load_pretrained(model_path)
        model.to(device).eval()
        return make_engine("hf", model, tokenizer, device=device)
    from ..models.loading import load_tokenizer

    return make_engine(
        kind, model_path, load_tokenizer(model_path), enable_sleep_mode=False, gpu_memory_utilization=0.85
    )


def in_prompt_format(task, model: ModelSpec, prompt_format: tuple[str, str]):
    """`task` with its prompts in `model`'s chat template and system prompt (`prompt_format`), or
    `task` itself when there is no template. The tokenizer is the model's own (saved with it, the
    official template included when the model was trained with it)."""
    template, system = prompt_format
    if not template:
        return task
    from ..models.loading import load_tokenizer
    from ..tasks.chat import ChatPromptTask

    try:
        return ChatPromptTask(task, load_tokenizer(model.path), system, template)
    except ValueError as error:
        raise ValueError(f"model {model.label!r}: {error}") from None


def _run_config(path: Path) -> dict:
    """A run directory's config.yaml, read as plain data (`config_files`)."""
    values = config_files.read(path) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a mapping of config keys")
    return values


def check_models(models: list[ModelSpec]) -> None:
    """`models.files.check_model` of each model: one line naming what cannot load."""
    for model in models:
        check_model(model.path, f"--model {model.label!r}")


def fingerprints(models: list[ModelSpec], out: Path) -> dict[str, str]:
    """{label: `models.files.fingerprint`} (an --out inside a model's folder is not part of it)."""
    return {m.label: fingerprint(m.path, skip=out) for m in models}


def check_prompt_lengths(task, problems: list, model: ModelSpec, max_tokens: int) -> None:
    """Refuse, naming the problem, a prompt of `task` longer than `max_tokens` tokens of the model's
    tokenizer (which is loaded only if some prompt has more bytes than `max_tokens`)."""
    tokenizer = None
    for problem in problems:
        prompt = task.prompt(problem)
        size = len(prompt.encode("utf-8"))
        if size <= max_tokens:  # a token is at least one byte
            continue
        if size > max_tokens * MAX_BYTES_PER_TOKEN:
            count = f"{size} bytes"
        else:
            if tokenizer is None:
                from ..models.loading import load_tokenizer

                tokenizer = load_tokenizer(model.path)
            tokens = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            if tokens <= max_tokens:
                continue
            count = f"{tokens} tokens"
        raise ValueError(
            f"task {task.name!r}: the prompt of problem {problem.id!r} is {count} long, more than "
            f"--max-prompt-tokens {max_tokens} allows for model {model.label!r}; raise --max-prompt-tokens "
            f"or fix the problem"
        )
