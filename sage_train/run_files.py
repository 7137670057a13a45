"""The entries of a run directory (``TrainConfig.run_dir``), named once: every writer and reader of a
run directory (the run, its checkpoints, loggers and warm start, sage-eval, sage-study) takes their
names from `RUN_FILES`, and the run directory's rules (`FRESH_RUN_CLEARS`, `RUN_ENTRIES`) derive
from the same record."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


def _output(name: str):
    """A previous run's output: a fresh run over it is refused, unless ``overwrite``, which deletes it."""
    return field(default=name, metadata={"output": True})


def _entry(name: str):
    """An entry a run writes or reads that is not an output (none may be a link: `safe_files`)."""
    return field(default=name, metadata={"output": False})


@dataclass(frozen=True)
class RunFiles:
    """A run directory's entries, in the order a refused fresh run lists them."""

    checkpoints: str = _output("checkpoints")  # one complete folder per saved step (`checkpoint`)
    sft: str = _output("sft")  # the warm-started model or adapter
    final: str = _output("final")  # the trained policy (HF format)
    tensorboard: str = _output("tensorboard")
    wandb: str = _output("wandb")
    metrics: str = _output("metrics.jsonl")  # a row per logged step
    eval_before: str = _output("eval_before.json")
    eval_after: str = _output("eval_after.json")
    summary: str = _output("summary.json")
    plot: str = _output("metrics.png")
    completions: str = _output("completions.jsonl")  # log_completions
    eval: str = _output("eval")  # sage-eval's default --out for a run's models
    study_eval: str = _output("study_eval")  # sage-study's evaluation of the run
    config: str = _entry("config.yaml")  # the run's config, saved at its start (and in each checkpoint)
    lock: str = _entry("run.lock")  # a run's `RunLock`
    rollout_init: str = _entry("rollout_init")  # the model a vLLM engine starts from (`build.rollout_model_path`)
    #: inside sft/: the number of SFT steps the warm start took (a study records it per seed)
    warm_start: str = field(default="warm_start.json", metadata={"output": None})
    #: sage-study's record of the environment the run was trained and evaluated in (`study.grid`)
    study_env: str = field(default="study_env.json", metadata={"output": None})
    #: the openai engine's adapters when ``openai_shared_dir`` is unset (shared with its server)
    adapters: str = field(default="adapters", metadata={"output": None})
    #: the run an ``overwrite`` replaces, kept whole until the new run has run its first step
    #: (`run_dir.move_previous_aside`); then renamed to `discarded` and deleted
    previous_run: str = field(default=".previous_run", metadata={"output": None})
    #: a previous run's entries on their way into `previous_run` or back out of it: they all belong in
    #: the run directory, which then holds nothing of the new run (`run_dir.recover_previous_run`)
    moving: str = field(default=".previous_run.moving", metadata={"output": None})
    discarded: str = field(default=".previous_run.discarded", metadata={"output": None})


RUN_FILES = RunFiles()
#: a previous run's outputs: a fresh run over any of them is refused, unless ``overwrite``, which deletes
#: them (the evaluations of its models too: sage-eval's default --out and sage-study's)
FRESH_RUN_CLEARS = tuple(getattr(RUN_FILES, f.name) for f in fields(RunFiles) if f.metadata["output"])
#: every entry of a run directory a run writes or reads (none may be a link: `safe_files`)
RUN_ENTRIES = tuple(getattr(RUN_FILES, f.name) for f in fields(RunFiles) if f.metadata["output"] is not None)
#: what ``overwrite`` moves aside: every entry of a run directory a run writes, but its lock
REPLACED_BY_OVERWRITE = FRESH_RUN_CLEARS + (RUN_FILES.config, RUN_FILES.rollout_init)
