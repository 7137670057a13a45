"""The run directory, in the order a run touches it (after `sage_train.inputs.check_inputs`, before
anything is built): `RunLock` (one run per directory), then `prepare_run_dir` (a fresh run, a resumed
one, or an overwritten one).

A previous run's checkpoints and final model are deleted only with ``overwrite``, and only once the
new run has proved it can run: `move_previous_aside` keeps the previous run whole in
``.previous_run/`` until the new run's first step has run (`discard_previous`); any failure before
then puts it back whole (`put_previous_back`). Every move is a rename, ordered so that a kill -9
anywhere leaves one run whole: the next run in the directory finishes the move
(`recover_previous_run`)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch.distributed as dist

from . import checkpoint, config_files
from .config import FIELDS, TrainConfig, build, resolve
from .distributed import on_rank0
from .errors import ConfigError
from .guide import is_scheduled
from .run_files import FRESH_RUN_CLEARS, REPLACED_BY_OVERWRITE, RUN_FILES
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
    unless ``overwrite``, which moves them aside (`move_previous_aside`; links among them moved, never
    followed). First of all, what a run killed while replacing another left is put right
    (`recover_previous_run`)."""
    on_rank0(rank, lambda: recover_previous_run(run_dir), ConfigError)  # what a killed --overwrite run left
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
                print(_extension_note(saved_steps, cfg.steps, done, cfg.lr_schedule, cfg.guide), flush=True)
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
            if cfg.overwrite and move_previous_aside(run_dir):
                print(
                    f"sage-train: --overwrite: starting {run_dir} afresh (the previous run is kept in "
                    f"{RUN_FILES.previous_run}/ until this one's first step has run)",
                    flush=True,
                )
            ended = [run_dir / name for name in FRESH_RUN_CLEARS if os.path.lexists(run_dir / name)]  # empty ones
        for path in ended:
            remove(path)
        make_dir(run_dir)
        config_files.save_yaml(cfg.to_dict(), run_dir / RUN_FILES.config)
    dist.barrier()
    return (usable, skipped) if cfg.resume else ([], [])


#: tests set it to a phase of `_kill_point` to kill -9 the run there
KILL_AT_ENV = "SAGE_TRAIN_TEST_KILL_AT"


def _kill_point(phase: str) -> None:
    """Where a test kills the run with SIGKILL (`KILL_AT_ENV` = `phase`), to check that a kill at any
    point of replacing a run leaves one run whole."""
    if os.environ.get(KILL_AT_ENV) == phase:
        os.kill(os.getpid(), signal.SIGKILL)


def move_previous_aside(run_dir: Path) -> bool:
    """``overwrite``'s first move (rank 0): the previous run's entries (`REPLACED_BY_OVERWRITE`) renamed
    into ``.previous_run.moving/``, which is then renamed to ``.previous_run/``: until that one rename
    the run directory holds nothing of the new run, and a kill leaves ``.moving``, whose entries
    `recover_previous_run` renames back. Returns whether there was anything to move."""
    names = [name for name in REPLACED_BY_OVERWRITE if os.path.lexists(run_dir / name)]
    if not names:
        return False
    moving = make_dir(run_dir / RUN_FILES.moving)
    for name in names:
        os.rename(run_dir / name, moving / name)  # a link is moved, never followed
        _kill_point("moving_aside")
    os.rename(moving, run_dir / RUN_FILES.previous_run)
    _kill_point("aside")
    return True


def put_previous_back(run_dir: Path) -> bool:
    """The run `move_previous_aside` kept, back whole (rank 0): the new run's entries deleted, then
    ``.previous_run/`` renamed to ``.previous_run.moving/`` and its entries renamed back (a kill
    while deleting leaves ``.previous_run``, one while renaming back ``.moving``: `recover_previous_run`
    finishes either). Returns whether there was one."""
    previous = _aside(run_dir, RUN_FILES.previous_run)
    if previous is None:
        return False
    for name in REPLACED_BY_OVERWRITE:
        remove(run_dir / name)
    os.rename(previous, run_dir / RUN_FILES.moving)
    _kill_point("putting_back")
    _move_back(run_dir)
    return True


def discard_previous(run_dir: Path) -> None:
    """The run `move_previous_aside` kept, deleted once the new run has run its first step (rank 0):
    renamed to ``.previous_run.discarded/`` first, so that a kill while deleting it leaves a name that
    `recover_previous_run` deletes, not one it puts back."""
    previous = _aside(run_dir, RUN_FILES.previous_run)
    if previous is None:
        return
    _kill_point("first_step")
    discarded = run_dir / RUN_FILES.discarded
    os.rename(previous, discarded)
    _kill_point("discarding")
    remove(discarded, quiet=True)  # what a read-only file left is deleted by the next run here


def recover_previous_run(run_dir: Path) -> None:
    """What a run killed while replacing a previous one left, put right before anything else (rank 0,
    under the run's lock): ``.discarded`` (killed after its first step) is deleted; ``.moving`` (killed
    while moving the previous run aside or back) and ``.previous_run`` (killed before its first step)
    are put back whole, the killed run's entries deleted."""
    discarded = _aside(run_dir, RUN_FILES.discarded)
    if discarded is not None:
        remove(discarded)
    if _aside(run_dir, RUN_FILES.moving) is not None:
        _move_back(run_dir)
    elif not put_previous_back(run_dir):
        return
    print(
        f"sage-train: {run_dir}: a run with --overwrite was stopped before its first step ended; the run "
        f"it was replacing is put back",
        flush=True,
    )


def _aside(run_dir: Path, name: str) -> Path | None:
    """``run_dir / name`` when it is a folder; None when absent; `RunDirError` when a link (never followed)."""
    path = run_dir / name
    if path.is_symlink():
        raise refused(path, OSError(errno.ELOOP, "a link"))
    return path if path.is_dir() else None


def _move_back(run_dir: Path) -> None:
    moving = run_dir / RUN_FILES.moving
    for name in sorted(os.listdir(moving)):
        os.rename(moving / name, run_dir / name)
    os.rmdir(moving)


def _has_content(path: Path) -> bool:
    return path.is_symlink() or path.is_file() or (path.is_dir() and any(path.iterdir()))


def _check_unchanged(cfg: TrainConfig, saved_path: Path, done: int) -> int:
    """The resumed config must equal the checkpoint's but for `RESUME_MAY_CHANGE` (keys the saved
    file has and this version no longer knows are ignored; a key it lacks, added since, is compared
    with the value the run had: its default, `_defaults_of`) and `RESUME_MAY_EXTEND` (``steps``, not
    below `done`, the checkpoint's step). Returns the saved ``steps``."""
    saved = config_files.read(saved_path) or {}
    if not isinstance(saved, dict):
        raise ConfigError(f"resume: {saved_path} is not a run config (a mapping of config keys)")
    exempt = RESUME_MAY_CHANGE + RESUME_MAY_EXTEND
    values = cfg.to_dict()
    had = {**_defaults_of(saved, [k for k in values if k not in saved and k not in exempt]), **saved}
    changed = sorted(k for k, v in values.items() if had[k] != v and k not in exempt)
    if changed:
        raise ConfigError(
            f"resume: config key(s) {changed} differ from the run's saved config "
            f"({', '.join(_change(k, had[k], getattr(cfg, k), k in saved) for k in changed)})"
        )
    if cfg.steps < done:
        raise ConfigError(
            f"resume: config key 'steps' is {cfg.steps}, below step {done} of the run's newest checkpoint, "
            f"where it continues; set steps >= {done}"
        )
    return saved.get("steps", cfg.steps)


def _defaults_of(saved: dict, keys: list[str]) -> dict:
    """The values `keys`, absent from a saved run config (added since), had in that run: their
    defaults, resolved with the saved keys as this version resolves a config (an algorithm preset
    fills its loss options); the dataclass defaults where the saved keys no longer make a valid config."""
    if not keys:
        return {}
    try:
        made = resolve(build({k: v for k, v in saved.items() if k in FIELDS}))
    except (ConfigError, TypeError, ValueError):
        made = TrainConfig()
    return {key: getattr(made, key) for key in keys}


def _change(key: str, had, value, saved: bool) -> str:
    return f"{key}: {had!r}{'' if saved else ' (absent: its default)'} -> {value!r}"


def _extension_note(saved_steps: int, steps: int, done: int, lr_schedule: str, guide: str) -> str:
    """What a resume with other ``steps`` (`saved_steps` -> `steps`) does, and to the schedules that
    depend on them (the learning rate's `lr_schedule`, the `guide`'s annealing)."""
    note = f"sage-train: --resume with steps {saved_steps} -> {steps}: steps 1..{done} are kept"
    depends = [f"the {lr_schedule} learning-rate decay"] if lr_schedule != "constant" else []
    if is_scheduled(guide):
        depends.append(f"the {guide} guide's annealing")
    if depends:
        note += (
            f"; {' and '.join(depends)} {'follows' if len(depends) == 1 else 'follow'} the {steps}-step "
            f"schedule from step {done + 1} on "
            f"(steps 1..{done} followed the {saved_steps}-step one)"
        )
    return note
