"""The run directory, in the order a run touches it: `check_inputs` (everything the run is built from,
before anything on disk changes), `RunLock` (one run per directory), then `prepare_run_dir` (a fresh
run, a resumed one, or an overwritten one; a previous run's checkpoints and final model are deleted
only with ``overwrite``)."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import checkpoint, config_files
from .build import chat_prompted, check_batch_shape, deepspeed_config
from .config import ConfigError, TrainConfig, plain_yaml, save_yaml
from .distributed import on_rank0
from .model_files import ModelFilesError, check_model
from .packaged_models import model_directory
from .safe_files import make_dir, open_lock, refuse_links, remove
from .tasks import TASK_NAMES, get_task

#: a previous run's outputs: a fresh run over any of them is refused, unless ``overwrite``, which deletes
#: them (the evaluations of its models too: sage-eval's default --out and sage-study's)
FRESH_RUN_CLEARS = (
    "checkpoints",
    "sft",
    "final",
    "tensorboard",
    "wandb",
    "metrics.jsonl",
    "eval_before.json",
    "eval_after.json",
    "summary.json",
    "metrics.png",
    "completions.jsonl",  # log_completions
    "eval",
    "study_eval",
)
RESUME_MAY_CHANGE = (
    "output_dir",  # the run directory was moved
    "name",  # or renamed, or copied: the name only labels the run (its folder, loggers and summary)
    "resume",
    "overwrite",
    "progress",
    "plots",
    "report_to",
    "report_project",
    "log_every",
    "save_every",
    "keep_checkpoints",
    "log_completions",
    "max_nonfinite_steps",
)
#: the key a resume may change to extend the run (or end it sooner, not before its checkpoint): the
#: steps done are kept; what depends on `steps` (the cosine / linear LR decay, the token and random
#: guides' annealing) follows the new total from the next step on (`_extension_note`), as HF
#: Trainer does with a larger max_steps
RESUME_MAY_EXTEND = ("steps",)
LOCK_FILE = "run.lock"  # a run's `RunLock`
#: every entry of a run directory a run writes or reads (none may be a link: `safe_files`)
RUN_ENTRIES = (*FRESH_RUN_CLEARS, "config.yaml", LOCK_FILE, "rollout_init")


class Inputs(NamedTuple):
    """The tasks and problems of a run, checked before the run directory is touched."""

    task: object
    train_problems: list
    sft_task: object
    sft_problems: list


def held_out_problems(cfg: TrainConfig, task, train_problems: list) -> list:
    """The ``eval_problems`` problems of `task`'s "test" split (drawn with ``held_out_seed``, None: the
    run's seed) that are not RL prompts. The synthetic tasks' splits are disjoint; a fixed list (a
    jsonl file, a math set) is the same list for every split, so its held-out problems are the rows
    after the RL pool (``train_problems``)."""
    rl = {p.id for p in train_problems}
    seed = cfg.seed if cfg.held_out_seed is None else cfg.held_out_seed
    problems = list(task.problems("test", cfg.eval_problems, seed))
    if any(p.id in rl for p in problems):
        problems = [p for p in task.problems("test", None, seed) if p.id not in rl][: cfg.eval_problems]
    if not problems:
        raise ConfigError(
            f"config key 'eval_splits': 'test' has no held-out problem, every problem of "
            f"{cfg.eval_task or cfg.task!r} is an RL prompt; set 'train_problems' below its size, or 'eval_task'"
        )
    return problems


def eval_set(cfg: TrainConfig, task, tokenizer, train_problems: list, split: str) -> tuple:
    """(task, problems) of a split: "train" and "test" evaluate (`run.evaluate_once`), "rl" is the RL pool."""
    if split == "rl":
        return task, train_problems
    if split == "train":
        return task, train_problems[: cfg.eval_problems]
    if cfg.eval_task:
        task = chat_prompted(cfg, get_task(cfg.eval_task), tokenizer)
    return task, held_out_problems(cfg, task, train_problems)


def run_prompts(cfg: TrainConfig, task, tokenizer, train_problems: list):
    """Every prompt the run samples, lazily: the RL pool's, then each evaluation split's."""
    for split in ["rl", *(cfg.eval_splits if cfg.eval_problems else [])]:
        split_task, problems = eval_set(cfg, task, tokenizer, train_problems, split)
        yield from (split_task.prompt(p) for p in problems)


def check_inputs(cfg: TrainConfig, world: int) -> Inputs:
    """Everything `cfg` names that can be wrong: the batch shape for `world` processes, a link among
    the run directory's files (`safe_files`), the DeepSpeed file, the tasks, the loggers' packages,
    the model (a GGUF file read). Raises `ConfigError` naming the key, or the link."""
    check_batch_shape(cfg, world)
    overwritten = FRESH_RUN_CLEARS if cfg.overwrite else ()  # removed as links, never followed
    refuse_links(cfg.run_dir, [name for name in RUN_ENTRIES if name not in overwritten], "run directory")
    deepspeed_config(cfg, world, 1, torch.device("cpu"))  # reads and checks the deepspeed_config file
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
    if "test" in cfg.eval_splits and cfg.eval_problems:
        held_out_problems(cfg, _task("eval_task", cfg.eval_task, {}) if cfg.eval_task else task, train_problems)
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
    _check_what_the_model_meets(cfg, model, task, sft_task, sft_problems)
    return Inputs(task, train_problems, sft_task, sft_problems)


def _check_what_the_model_meets(cfg: TrainConfig, model: str, task, sft_task, sft_problems: list) -> None:
    """The keys that fail only once a model exists, checked on its tokenizer and on a skeleton of it
    (no weights: the meta device) of `model` ("tiny" or what transformers loads): the chat template,
    the LoRA target modules, and the warm start's examples (`sft.sft_examples` refuses a set that
    leaves none)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .model import build_char_tokenizer, build_tiny_model, load_tokenizer
    from .sft import sft_examples

    tokenizer = build_char_tokenizer() if model == "tiny" else load_tokenizer(model)
    try:
        prompted = chat_prompted(cfg, sft_task, tokenizer)
    except ValueError as error:  # the tasks/chat.py messages name the template
        raise ConfigError(f"config key 'chat_template' with model {cfg.model!r}: {error}") from None
    if cfg.lora_rank:
        with torch.device("meta"):
            if model == "tiny":
                shape = dict(hidden_size=cfg.tiny_hidden_size, num_layers=cfg.tiny_layers, num_heads=cfg.tiny_heads)
                shape |= dict(num_kv_heads=cfg.tiny_kv_heads, intermediate_size=cfg.tiny_intermediate_size)
                skeleton = build_tiny_model(tokenizer, **shape, max_positions=cfg.tiny_max_positions, seed=cfg.seed)
            else:
                config = AutoConfig.from_pretrained(model, trust_remote_code=False)
                skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        names = {name.rsplit(".", 1)[-1] for name, _ in skeleton.named_modules()}
        missing = [m for m in cfg.lora_target_modules if m not in names]
        if missing:
            raise ConfigError(
                f"config key 'lora_target_modules': {missing} name no module of {cfg.model!r} (its modules "
                f"include {sorted(n for n in names if n.endswith('proj')) or sorted(names)[:12]})"
            )
    if cfg.warm_start:
        sft_examples(prompted, sft_problems, tokenizer, cfg)


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


class RunLock:
    """One run at a time in a run directory: rank 0 holds an exclusive ``flock`` on
    ``run_dir/run.lock`` for the run's life. The kernel drops the lock when its process dies, so a
    lock file still holding a holder's details but no lock is a stale one (a killed run): it is
    reported and taken over. A second run fails with `ConfigError` naming the holder.

    A sage-study holds one on its --out the same way (``owner="study"``: ``study.lock``)."""

    def __init__(self, run_dir: Path, rank: int, *, owner: str = "run", option: str = "--name"):
        self.path, self.rank, self.fd = Path(run_dir) / f"{owner}.lock", rank, None
        self.owner, self.option = owner, option

    def __enter__(self) -> RunLock:
        on_rank0(self.rank, self.acquire, ConfigError)
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        make_dir(self.path.parent)
        while True:
            fd = open_lock(self.path)  # never through a link: a run.lock linked elsewhere is refused
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise ConfigError(
                    f"{self.owner} directory {self.path.parent} is in use by {describe(holder)}; wait for that "
                    f"{self.owner} to end, or choose another {self.option}"
                ) from None
            try:  # its previous holder may have removed the file between our open and our lock
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = _read(fd)
        if stale:
            print(
                f"sage-{'train' if self.owner == 'run' else self.owner}: {self.path} was left by {describe(stale)}, "
                f"which ended without releasing it (killed?); taking it over",
                flush=True,
            )
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        os.fsync(fd)
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # before unlocking: a waiting run then re-opens a new file
        except OSError:  # a folder made read-only during the run: leave the file naming no holder
            try:
                os.ftruncate(self.fd, 0)
            except OSError:
                pass  # a read-only file system: the lock itself is released with the descriptor
        os.close(self.fd)
        self.fd = None


def _read(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"null") or {}
    except ValueError:
        holder = None
    if not isinstance(holder, dict):
        return {"pid": "?", "host": "?", "started": "?", "command": "(an unreadable lock file)"}
    return holder


def describe(holder: dict) -> str:
    return (
        f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} (started {holder.get('started', '?')}: "
        f"{holder.get('command', '?')})"
    )


def prepare_run_dir(cfg: TrainConfig, run_dir: Path, rank: int, world: int) -> tuple[list[Path], list[str]]:
    """Make `run_dir` ready and save the config (rank 0 writes; every rank checks the same files).

    With ``resume``: check the config against the run's (its newest checkpoint's, or before the
    first checkpoint the one saved at its start); returns (the complete checkpoints newest first,
    what was skipped) for `checkpoint.load` (none yet: the run starts at step 1, keeping its warm start).
    A resume with other ``steps`` extends the run (`RESUME_MAY_EXTEND`): the end it had (its
    summary.json, eval_after.json) is no longer its end and is removed.
    Without: a directory holding any of a previous run's outputs (`FRESH_RUN_CLEARS`) is refused
    unless ``overwrite``, which clears them (links among them removed, never followed)."""
    usable, skipped = checkpoint.find(run_dir, world)
    damaged = [s for s in skipped if s.startswith(checkpoint.TAG_PREFIX)]  # not a save that never finished
    ended = []  # a previous end of the run, when this resume moves it
    if cfg.resume:
        # the config the run was started with: its newest checkpoint's, else the one saved at its start
        # (a run killed before its first checkpoint keeps its warm start, which that config made)
        saved = usable[0] / "config.yaml" if usable else run_dir / "config.yaml"
        done = checkpoint.step_of(usable[0]) if usable else 0
        saved_steps = _check_unchanged(cfg, saved, done) if saved.is_file() else cfg.steps
        if saved_steps != cfg.steps:
            ended = [run_dir / name for name in ("summary.json", "eval_after.json") if os.path.lexists(run_dir / name)]
            if rank == 0:
                print(_extension_note(cfg, saved_steps, done), flush=True)
        if usable:
            pass  # checkpoint.load takes the newest that loads
        elif damaged:
            raise ConfigError(
                f"resume: no usable checkpoint in {checkpoint.checkpoint_dir(run_dir)}: {'; '.join(skipped)}. "
                f"Pass --overwrite instead of --resume to start afresh"
            )
        elif (run_dir / "final").exists():
            raise ConfigError(
                f"resume: {run_dir} holds a final model but no checkpoint to continue from; pass "
                f"--overwrite instead of --resume to train it afresh"
            )
        elif rank == 0:
            left = f" (skipped {'; '.join(skipped)})" if skipped else ""
            print(f"sage-train: no complete checkpoint in {run_dir} yet{left}: --resume starts at step 1", flush=True)
    else:
        kept = [name for name in FRESH_RUN_CLEARS if _has_content(run_dir / name)]
        if kept and not cfg.overwrite:
            listed = ", ".join(f"{n}/" if (run_dir / n).is_dir() else n for n in kept)
            raise ConfigError(
                f"run directory {run_dir} holds a previous run ({listed}); pass --resume to continue it, "
                f"--overwrite to replace it, or choose another --name"
            )
    if rank == 0:
        if not cfg.resume:
            ended = [run_dir / name for name in FRESH_RUN_CLEARS if os.path.lexists(run_dir / name)]
            if ended and cfg.overwrite:
                print(f"sage-train: --overwrite: starting {run_dir} afresh", flush=True)
        for path in ended:
            remove(path)
        make_dir(run_dir)
        save_yaml(cfg, run_dir / "config.yaml")
    dist.barrier()
    return (usable, skipped) if cfg.resume else ([], [])


def _has_content(path: Path) -> bool:
    return path.is_symlink() or path.is_file() or (path.is_dir() and any(path.iterdir()))


def _check_unchanged(cfg: TrainConfig, saved_path: Path, done: int) -> int:
    """The resumed config must equal the checkpoint's but for `RESUME_MAY_CHANGE` (keys the saved
    file has and this version no longer knows are ignored) and `RESUME_MAY_EXTEND` (``steps``, not
    below `done`, the checkpoint's step). Returns the saved ``steps``."""
    saved = plain_yaml(config_files.read, saved_path) or {}
    if not isinstance(saved, dict):
        raise ConfigError(f"resume: {saved_path} is not a run config (a mapping of config keys)")
    exempt = RESUME_MAY_CHANGE + RESUME_MAY_EXTEND
    changed = sorted(k for k, v in cfg.to_dict().items() if k in saved and saved[k] != v and k not in exempt)
    if changed:
        raise ConfigError(
            f"resume: config key(s) {changed} differ from the run's saved config "
            f"({', '.join(f'{k}: {saved.get(k)!r} -> {getattr(cfg, k)!r}' for k in changed)})"
        )
    if cfg.steps < done:
        raise ConfigError(
            f"resume: config key 'steps' is {cfg.steps}, below step {done} of the run's newest checkpoint, "
            f"where it continues; set steps >= {done}"
        )
    return saved.get("steps", cfg.steps)


def _extension_note(cfg: TrainConfig, saved_steps: int, done: int) -> str:
    """What a resume with other ``steps`` does, and to the schedules that depend on them."""
    note = f"sage-train: --resume with steps {saved_steps} -> {cfg.steps}: steps 1..{done} are kept"
    depends = [f"the {cfg.lr_schedule} learning-rate decay"] if cfg.lr_schedule != "constant" else []
    if cfg.guide in ("token", "random"):
        depends.append(f"the {cfg.guide} guide's annealing")
    if depends:
        note += (
            f"; {' and '.join(depends)} {'follows' if len(depends) == 1 else 'follow'} the {cfg.steps}-step "
            f"schedule from step {done + 1} on "
            f"(steps 1..{done} followed the {saved_steps}-step one)"
        )
    return note
