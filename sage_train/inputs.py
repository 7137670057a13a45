"""What a run is built from, checked before anything is built or any file changes: `check_inputs`
returns one frozen `RunPlan` (the tasks and their problem sets, the held-out problems drawn once, the
rows and accumulation of a step, the DeepSpeed config, the model source and its tokenizer, the warm
start's prompted task) that the builder (`sage_train.build`) consumes as it is, so nothing is built
once to be checked and again to be used. A bad key raises `ConfigError` naming it, in the order the checks below run."""

from __future__ import annotations

import importlib.util
import typing
from dataclasses import dataclass

import torch

from .config import TrainConfig
from .config_files import read_mapping
from .context import Settings, StepSettings
from .errors import ConfigError
from .eval.evaluate import EvalSettings
from .guide import GuideSettings
from .models.files import ModelFilesError, check_model
from .models.loading import load_skeleton, model_directory, tokenizer_for
from .optim import OptimSettings
from .presets import loss_config
from .records import settings_of
from .run_files import FRESH_RUN_CLEARS, RUN_ENTRIES
from .safe_files import refuse_links
from .sft import sft_examples
from .tasks import TASK_NAMES, get_task
from .tasks.base import Problem, Task
from .tasks.chat import chat_prompted


@dataclass(frozen=True)
class RunPlan:
    """Everything `cfg` names, checked (`check_inputs`): what the builder starts from."""

    settings: Settings  # the run's settings records (`run_settings`)
    world: int
    task: Task  # the RL task, in its own prompt format (the builder puts it in the policy tokenizer's)
    train_problems: list[Problem]  # the RL pool
    sft_examples: list[tuple[list[int], list[int]]]  # the warm start's (`sft_examples`); [] without one
    eval_task: Task | None  # ``eval_task``'s task when it is set and "test" is evaluated (None: the RL task)
    held_out: list[Problem]  # the "test" split's problems (`held_out_problems`), drawn once; [] when not evaluated
    local_rows: int  # each rank's rows per step: its prompts x group_size (`check_batch_shape`)
    accumulation: int  # DeepSpeed's nominal micro-batches per update
    deepspeed: dict  # the DeepSpeed config (`deepspeed_config`), the file merged in
    model: str  # the model source: "tiny", a hub id or a directory (a named model's or GGUF's cached conversion)
    tokenizer: object  # the model source's tokenizer (`loading.tokenizer_for`)


def check_inputs(cfg: TrainConfig, world: int, device: torch.device | None = None) -> RunPlan:
    """Everything `cfg` names that can be wrong: the batch shape for `world` processes, a link among
    the run directory's files (`safe_files`), the DeepSpeed file, the tasks, the loggers' packages,
    the model (a GGUF file read) and what it meets. Raises `ConfigError` naming the key, or the link.
    `device` (CPU if None) is where the run trains: the DeepSpeed config's bf16 follows it."""
    settings = run_settings(cfg)
    local_rows = check_batch_shape(settings.step, world)
    overwritten = FRESH_RUN_CLEARS if cfg.overwrite else ()  # removed as links, never followed
    refuse_links(cfg.run_dir, [name for name in RUN_ENTRIES if name not in overwritten], "run directory")
    # DeepSpeed's nominal accumulation: the update marks its last micro-batch itself (a token budget varies their count)
    accumulation = max(1, local_rows // cfg.micro_batch_size)
    deepspeed = deepspeed_config(settings.optim, world, accumulation, device or torch.device("cpu"))
    task = _task("task", cfg.task, cfg.task_options)
    sft_problems = list(task.problems("train", None, cfg.seed))
    if cfg.train_problems > len(sft_problems):  # the synthetic tasks are unbounded: draw the larger pool asked for
        sft_problems = list(task.problems("train", cfg.train_problems, cfg.seed))
    train_problems = sft_problems[: cfg.train_problems] if cfg.train_problems else sft_problems
    if len(train_problems) < cfg.prompts_per_step * cfg.steps_per_generation:
        raise ConfigError(
            f"config key 'train_problems': {len(train_problems)} problems cannot fill a generation of "
            f"prompts_per_step x steps_per_generation = {cfg.prompts_per_step * cfg.steps_per_generation}"
        )
    sft_task = task
    if cfg.sft_task and cfg.warm_start:  # warm-start on another dataset's solutions
        sft_task = _task("sft_task", cfg.sft_task, {})
        sft_problems = list(sft_task.problems("train", None, cfg.seed))
    eval_task, held_out = None, []
    if "test" in cfg.eval_splits and cfg.eval_problems:
        eval_task = _task("eval_task", cfg.eval_task, {}) if cfg.eval_task else None
        held_out = held_out_problems(
            settings.evaluation, cfg.seed, cfg.eval_task or cfg.task, eval_task or task, train_problems
        )
    for logger in cfg.report_to:  # each logger is its own package, not a dependency of sage-train
        if importlib.util.find_spec(logger) is None:
            raise ConfigError(f"config key 'report_to': {logger!r} needs its package (pip install {logger})")
    if cfg.rollout_engine == "vllm" and (importlib.util.find_spec("vllm") is None or not torch.cuda.is_available()):
        raise ConfigError(
            "config key 'rollout_engine': 'vllm' needs vLLM on a CUDA machine (pip install 'sage-rl[vllm]')"
        )
    # a named model or a GGUF file is read now (converted once, into the model cache), like any model
    model = model_directory(cfg.model, cfg.gguf_file)
    if model != "tiny":
        try:
            check_model(model, "config key 'model' (expected 'tiny', a hub id or a model directory)")
        except ModelFilesError as error:
            raise ConfigError(str(error)) from None
    tokenizer, examples = _check_what_the_model_meets(settings, model, sft_task, sft_problems)
    return RunPlan(
        settings,
        world,
        task,
        train_problems,
        examples,
        eval_task,
        held_out,
        local_rows,
        accumulation,
        deepspeed,
        model,
        tokenizer,
    )


def _check_what_the_model_meets(settings: Settings, model: str, sft_task, sft_problems: list) -> tuple:
    """The keys that fail only once a model exists, checked on its tokenizer and on a skeleton of it
    (no weights: `loading.load_skeleton`): the chat template, the LoRA target modules, and the warm
    start's examples (`sft_examples` refuses a set that leaves none). Returns (the tokenizer, the
    warm start's examples: [] without a warm start)."""
    try:
        tokenizer = tokenizer_for(model)
    except ModelFilesError as error:
        raise ConfigError(f"config key 'model': {error}") from None
    try:
        prompted = chat_prompted(settings.chat, sft_task, tokenizer)
    except ValueError as error:  # the tasks/chat.py messages name the template
        raise ConfigError(f"config key 'chat_template' with model {settings.model.model!r}: {error}") from None
    lora, sft = settings.lora, settings.sft
    if lora.lora_rank:
        names = {name.rsplit(".", 1)[-1] for name, _ in load_skeleton(settings.model, model, tokenizer).named_modules()}
        missing = [m for m in lora.lora_target_modules if m not in names]
        if missing:
            raise ConfigError(
                f"config key 'lora_target_modules': {missing} name no module of {settings.model.model!r} (its modules "
                f"include {sorted(n for n in names if n.endswith('proj')) or sorted(names)[:12]})"
            )
    if not sft.warm_start:
        return tokenizer, []
    return tokenizer, sft_examples(prompted, sft_problems, tokenizer, sft, sft.sft_task or settings.run.task)


def _task(key: str, name: str, options: dict):
    try:
        return get_task(name, **options)
    except (TypeError, ValueError, OSError) as error:
        problem = str(error)
    if name not in TASK_NAMES:
        if options:
            try:  # the name, not its options, may be what is wrong
                get_task(name)
            except (TypeError, ValueError, OSError) as error:
                problem = str(error)
        problem = f"{name!r} is not one of {', '.join(TASK_NAMES)} nor a math source: {problem}"
    raise ConfigError(f"config key {key!r}: {problem}")


def check_batch_shape(shape: StepSettings, world: int) -> int:
    """Each rank's rows per step (its prompts x group_size); they must split into micro-batches
    (of ``micro_batch_size`` rows, unless a token budget makes them)."""
    local_rows = shape.prompts_per_step // world * shape.group_size
    if shape.prompts_per_step % world or (local_rows % shape.micro_batch_size and not shape.max_tokens_per_micro_batch):
        raise ConfigError(
            f"config key 'prompts_per_step' ({shape.prompts_per_step}) must split evenly over "
            f"{world} rank(s), and each rank's prompts x group_size ({local_rows}) into "
            f"'micro_batch_size' ({shape.micro_batch_size}) micro-batches"
        )
    return local_rows


def deepspeed_config(optim: OptimSettings, world: int, accumulation: int, device: torch.device) -> dict:
    """The DeepSpeed config implied by `optim`, with its ``deepspeed_config`` (a file) merged over it."""
    config = {
        "train_micro_batch_size_per_gpu": optim.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": optim.micro_batch_size * accumulation * world,
        "gradient_clipping": optim.max_grad_norm,
        "zero_optimization": {"stage": optim.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": device.type == "cuda" and optim.bf16},
        "steps_per_print": 2**31,
        "wall_clock_breakdown": False,
    }
    if optim.deepspeed_config:
        for key, value in read_mapping(optim.deepspeed_config).items():  # JSON is YAML too
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
    stage = config["zero_optimization"].get("stage", 0)
    if stage != optim.zero_stage:
        raise ConfigError(
            f"config key 'deepspeed_config' ({optim.deepspeed_config}) sets ZeRO stage {stage} but "
            f"'zero_stage' is {optim.zero_stage}; make them agree (the trainer reads zero_stage)"
        )
    return config


def engine_config(settings: Settings, world: int, device: torch.device) -> dict:
    """The DeepSpeed config of a run of `settings` on `world` processes (what `check_inputs` plans),
    for building engines without a whole plan."""
    rows = check_batch_shape(settings.step, world)
    return deepspeed_config(settings.optim, world, max(1, rows // settings.step.micro_batch_size), device)


def held_out_problems(evaluation: EvalSettings, seed: int, task_name: str, task, train_problems: list) -> list:
    """The ``eval_problems`` problems of `task` (called `task_name`)'s "test" split (drawn with
    ``held_out_seed``, None: the run's `seed`) that are not RL prompts. The synthetic tasks' splits are
    disjoint; a fixed list (a jsonl file, a math set) is the same list for every split, so its
    held-out problems are the rows after the RL pool (``train_problems``)."""
    rl = {p.id for p in train_problems}
    seed = seed if evaluation.held_out_seed is None else evaluation.held_out_seed
    problems = list(task.problems("test", evaluation.eval_problems, seed))
    if any(p.id in rl for p in problems):
        problems = [p for p in task.problems("test", None, seed) if p.id not in rl][: evaluation.eval_problems]
    if not problems:
        raise ConfigError(
            f"config key 'eval_splits': 'test' has no held-out problem, every problem of "
            f"{task_name!r} is an RL prompt; set 'train_problems' below its size, or 'eval_task'"
        )
    return problems


def evaluation_sets(evaluation: EvalSettings, task, held_out_task, train_problems: list, held_out: list) -> dict:
    """(task, problems) of each split of ``eval_splits``, in their order, which `run.evaluate_once`
    samples ({} when ``eval_problems`` is 0): "train" the first ``eval_problems`` RL prompts in
    `task`'s prompts, "test" the `held_out` problems in `held_out_task`'s."""
    sets = {"train": (task, train_problems[: evaluation.eval_problems]), "test": (held_out_task, held_out)}
    return {split: sets[split] for split in evaluation.eval_splits} if evaluation.eval_problems else {}


def run_prompts(task, train_problems: list, evaluations: dict):
    """Every prompt the run samples, lazily: the RL pool's, then each evaluation set's."""
    yield from (task.prompt(p) for p in train_problems)
    for split_task, problems in evaluations.values():
        yield from (split_task.prompt(p) for p in problems)


def run_settings(cfg: TrainConfig) -> Settings:
    """The settings records of a checked, resolved TrainConfig (`records.settings_of` each), and its
    keys as saved."""
    kinds = {name: kind for name, kind in typing.get_type_hints(Settings).items() if name not in ("loss", "saved")}
    records = {name: settings_of(kind, cfg, "guide_" if kind is GuideSettings else "") for name, kind in kinds.items()}
    return Settings(**records, loss=loss_config(cfg), saved=cfg.to_dict())
