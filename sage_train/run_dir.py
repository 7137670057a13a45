"""The run directory, in the order a run touches it (after `sage_train.inputs.check_inputs`, before
anything is built): `RunLock` (one run per directory), then `prepare_run_dir` (a fresh run, a resumed
one, or an overwritten one; a previous run's checkpoints and final model are deleted only with
``overwrite``)."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch.distributed as dist

from . import checkpoint, config_files
from .config import TrainConfig
from .distributed import on_rank0
from .errors import ConfigError
from .presets import is_scheduled
from .run_files import FRESH_RUN_CLEARS, RUN_FILES
from .safe_files import make_dir, open_lock, own_copy, refused, remove

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
        if os.fstat(fd).st_nlink > 1:  # hard-linked (cp -al, or planted): the holder is never written there
            try:
                fd = own_copy(self.path, fd, keep_data=False)
            except OSError as error:  # e.g. a read-only folder
                os.close(fd)
                raise refused(self.path, error) from None
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
    except (ValueError, RecursionError):  # 4096 bytes of "[" nest deeper than the parser goes
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
        saved = (usable[0] if usable else run_dir) / RUN_FILES.config
        done = checkpoint.step_of(usable[0]) if usable else 0
        saved_steps = _check_unchanged(cfg, saved, done) if saved.is_file() else cfg.steps
        if saved_steps != cfg.steps:
            ended = [
                run_dir / name for name in (RUN_FILES.summary, RUN_FILES.eval_after) if os.path.lexists(run_dir / name)
            ]
            if rank == 0:
                print(_extension_note(cfg, saved_steps, done), flush=True)
        if usable:
            pass  # checkpoint.load takes the newest that loads
        elif damaged:
            raise ConfigError(
                f"resume: no usable checkpoint in {checkpoint.checkpoint_dir(run_dir)}: {'; '.join(skipped)}. "
                f"Pass --overwrite instead of --resume to start afresh"
            )
        elif (run_dir / RUN_FILES.final).exists():
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
        config_files.save_yaml(cfg, run_dir / RUN_FILES.config)
    dist.barrier()
    return (usable, skipped) if cfg.resume else ([], [])


def _has_content(path: Path) -> bool:
    return path.is_symlink() or path.is_file() or (path.is_dir() and any(path.iterdir()))


def _check_unchanged(cfg: TrainConfig, saved_path: Path, done: int) -> int:
    """The resumed config must equal the checkpoint's but for `RESUME_MAY_CHANGE` (keys the saved
    file has and this version no longer knows are ignored) and `RESUME_MAY_EXTEND` (``steps``, not
    below `done`, the checkpoint's step). Returns the saved ``steps``."""
    saved = config_files.read(saved_path) or {}
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
    if is_scheduled(cfg.guide):
        depends.append(f"the {cfg.guide} guide's annealing")
    if depends:
        note += (
            f"; {' and '.join(depends)} {'follows' if len(depends) == 1 else 'follow'} the {cfg.steps}-step "
            f"schedule from step {done + 1} on "
            f"(steps 1..{done} followed the {saved_steps}-step one)"
        )
    return note
