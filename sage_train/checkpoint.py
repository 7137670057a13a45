"""Save and resume a run exactly; a checkpoint is complete or absent.

A checkpoint is ``runs/<name>/checkpoints/step<N>/``: DeepSpeed's own files (model,
optimizer and LR-scheduler states, partitioned as the ZeRO stage partitions them), the
resolved ``config.yaml``, one ``rank<r>.pt`` per process with what DeepSpeed does not
keep (the Python, NumPy and torch RNG states and the guide's state: its schedule position
and, for the random guide, its generator), and ``manifest.json``, the size of every file.
The data position is the step number itself: the trainer draws each step's prompts from a
generator seeded by (seed, step), so resuming at step N draws what an uninterrupted run
would have drawn.

Writing: everything goes to ``checkpoints/.partial/step<N>/``, is fsynced, then renamed into
place; ``checkpoints/latest`` (the file DeepSpeed's tools read) is replaced last. A kill or a
full disk at any moment leaves the previous checkpoints as they were. Resuming does not trust
``latest``: it takes the newest ``step*`` whose manifest matches the files on disk and loads;
the ones it skips are named.

Loading: a checkpoint is data, never code. Every file, ours and DeepSpeed's, is read by
`load_data` (``torch.load(weights_only=True)``), which builds tensors, plain containers and the
few classes `_data_classes` names, and nothing else: a run directory received from someone else
cannot run code on ``--resume``. A file holding anything else refuses the resume by name.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .config_files import save_yaml
from .errors import ConfigError, NotAFileError, RunError
from .run_files import RUN_FILES
from .safe_files import (
    PARTIAL,
    fresh_dir,
    fsync_path,
    full_disk,
    read_json,
    read_text,
    remove,
    replace_folder,
    write_file,
)

TAG_PREFIX = "step"
MANIFEST = "manifest.json"
#: the most bytes read of `latest` (a step folder's name) and of a manifest (a size per file of a
#: save): a received run's oversized or endless file is refused, not read
LATEST_MAX, MANIFEST_MAX = 4096, 16 << 20


@dataclass(frozen=True)
class CheckpointSettings:
    """When a run saves a checkpoint (every ``save_every`` steps, and at its last) and how many it keeps
    (``keep_checkpoints``; 0: all)."""

    save_every: int
    keep_checkpoints: int


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / RUN_FILES.checkpoints


def tag_of(step: int) -> str:
    return f"{TAG_PREFIX}{step:06d}"


def step_of(path: Path) -> int | None:
    digits = path.name[len(TAG_PREFIX) :]
    return int(digits) if path.name.startswith(TAG_PREFIX) and digits.isdigit() else None


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def frozen_weights_left_out(module):
    """`module.state_dict()` without its frozen parameters while inside, under every name they have
    (DeepSpeed's own ``exclude_frozen_parameters`` misses the second name of a tied weight: SmolLM2's
    frozen 113 MB head, ``lm_head.weight`` beside ``embed_tokens.weight``)."""
    frozen = [name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad]

    def drop(_module, state, prefix, _metadata):
        for name in frozen:
            state.pop(prefix + name, None)

    handle = module._register_state_dict_hook(drop)
    try:
        yield
    finally:
        handle.remove()


class UntrustedFileError(ConfigError):
    """A checkpoint file holding Python objects that are not data (loading it would run code)."""


def _data_classes() -> list:
    """What `load_data` builds besides tensors and plain containers: NumPy's RNG state (rank<r>.pt)
    and the enum, fragment address and loss scaler in DeepSpeed's ZeRO optimizer states."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    numpy_rng = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), multiarray._reconstruct]
    return [*numpy_rng, ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler]


def load_data(path, map_location=None):
    """`torch.load` of a checkpoint file as data (module docstring); `UntrustedFileError` naming
    what else it holds, before any of it is built."""
    with torch.serialization.safe_globals(_data_classes()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as error:
            if "Weights only load failed" not in str(error):
                raise  # a damaged file, not a refused one
            found = sorted(set(re.findall(r"GLOBAL (\S+)", str(error)))) or ["an object that is not data"]
            raise UntrustedFileError(
                f"{path} holds Python objects other than tensors and plain data ({', '.join(found)}); loading "
                f"it could run code, so it is refused"
            ) from None


def save(engine, run_dir: Path, step: int, config: dict, guide, *, keep: int) -> Path:
    """Write checkpoint `step` from every rank (a collective call), with the run's `config` (its saved
    keys), then drop all but the newest `keep` up to `step` (0 keeps all). Raises `RunError` (on every
    rank) when it cannot be written; the previous checkpoints are then untouched."""
    root = checkpoint_dir(run_dir)
    staging, tag = root / PARTIAL, tag_of(step)
    rank, error = dist.get_rank(), None
    if rank == 0:
        try:
            fresh_dir(staging)  # whatever a killed save left (or a link put there): DeepSpeed writes inside
        except OSError as caught:  # the save below fails as well (every rank takes part): this says why
            error = _write_failure(caught, root, tag)
    dist.barrier()
    try:
        with frozen_weights_left_out(engine.module):  # a LoRA run's base: the run rebuilds it from `model`
            engine.save_checkpoint(str(staging), tag=tag, client_state={"step": step}, save_latest=False)
        state = {"rng": rng_state(), "guide": guide.state_dict() if guide is not None else None}
        torch.save(state, staging / tag / f"rank{rank}.pt")
        if rank == 0:
            save_yaml(config, staging / tag / RUN_FILES.config)
    except (OSError, RuntimeError) as caught:  # torch reports a failed write as a RuntimeError
        error = error or _write_failure(caught, root, tag)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    error = next((e for e in errors if e), None)
    if error is None and rank == 0:
        try:
            _commit(root, staging / tag, dist.get_world_size())
        except OSError as caught:
            error = _write_failure(caught, root, tag)
    shared = [error]
    dist.broadcast_object_list(shared, src=0)
    if shared[0]:
        if rank == 0:
            remove(staging, quiet=True)
        dist.barrier()
        raise RunError(shared[0])
    if rank == 0:
        for extra in staging.iterdir():  # DeepSpeed's zero_to_fp32.py & co. go beside the checkpoints
            os.replace(extra, root / extra.name)
        staging.rmdir()
    if rank == 0 and keep:
        done = [p for p in sorted(root.glob(f"{TAG_PREFIX}*")) if (step_of(p) or 0) <= step]
        for old in done[:-keep]:
            remove(old, quiet=True)
    dist.barrier()
    return root / tag


def _commit(root: Path, written: Path, world: int) -> None:
    """Manifest and fsync the staged checkpoint, rename it into place, then point `latest` at it."""
    sizes = {}
    for path in sorted(p for p in written.rglob("*") if p.is_file()):
        fsync_path(path)
        sizes[str(path.relative_to(written))] = path.stat().st_size
    write_file(written / MANIFEST, json.dumps({"world_size": world, "files": sizes}, indent=1) + "\n", sync=True)
    for folder in {p.parent for p in written.rglob("*")} | {written}:
        fsync_path(folder)
    final = root / written.name
    replace_folder(final, written)  # an existing one: a checkpoint of a timeline abandoned by a resume
    fsync_path(root)
    write_file(root / "latest", final.name, sync=True)
    fsync_path(root)


def _write_failure(error: Exception, root: Path, tag: str) -> str:
    """One line for a checkpoint that could not be written, naming a full disk as such."""
    free = full_disk(error, root)
    kept = latest_complete_name(root)
    previous = f"the previous checkpoint {kept} stays 'latest'" if kept else "no earlier checkpoint exists"
    if free is not None:
        return (
            f"checkpoint {tag}: no space left on device in {root} ({free} bytes free); {previous}. "
            f"Free some space and continue with --resume"
        )
    return f"checkpoint {tag} could not be written to {root}: {error}; {previous}"


def latest_complete_name(root: Path) -> str | None:
    latest = root / "latest"
    try:
        name = read_text(latest, LATEST_MAX).strip()
    except (OSError, ValueError):
        return None
    return name if name and (root / name / MANIFEST).is_file() else None


def verify(path: Path, world: int) -> str | None:
    """Why checkpoint folder `path` cannot be resumed by `world` processes, or None when its
    manifest matches the files on disk (what a truncation or a half-copied folder breaks).
    `NotAFileError` when the manifest is not a regular file (a FIFO would block the read)."""
    try:
        manifest = read_json(path / MANIFEST, MANIFEST_MAX)
        sizes, saved_world = manifest["files"], manifest["world_size"]
    except FileNotFoundError:
        return f"no {MANIFEST}: not a complete checkpoint"
    except NotAFileError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable {MANIFEST} ({error})"
    if saved_world != world:
        return f"saved by {saved_world} process(es), resumed by {world}"
    for name, size in sizes.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written"
    return None


def find(run_dir: Path, world: int) -> tuple[list[Path], list[str]]:
    """(the complete checkpoints, newest first; what was skipped and why, as "name (why)")."""
    root = checkpoint_dir(run_dir)
    usable, skipped = [], []
    for path in sorted((p for p in root.glob(f"{TAG_PREFIX}*") if step_of(p) is not None), reverse=True):
        why = verify(path, world)
        (skipped.append(f"{path.name} ({why})") if why else usable.append(path))
    if (root / PARTIAL).is_dir():
        for path in sorted((root / PARTIAL).iterdir()):
            skipped.append(f"{PARTIAL}/{path.name} (a save that did not finish)")
    if os.path.lexists(root / "latest"):
        try:
            named = read_text(root / "latest", LATEST_MAX).strip()
        except NotAFileError:
            raise
        except (OSError, ValueError) as error:
            named = f"<unreadable: {error}>"
        if not usable or named != usable[0].name:
            skipped.append(
                f"'latest' ({'empty' if not named else f'names {named}'}, not the newest complete checkpoint)"
            )
    return usable, skipped


def load(engine, candidates: list[Path], skipped: list[str], guide) -> int:
    """Restore the first of `candidates` that loads on every rank into `engine`, the RNGs and
    `guide`; returns its step. Falls back to older ones with a warning naming what was skipped;
    `ConfigError` when none loads (the user chooses: repair, or --overwrite)."""
    skipped = list(skipped)
    engine.checkpoint_engine.load = load_data  # DeepSpeed's own states too (its loader unpickles anything)
    for path in candidates:
        failure = untrusted = None
        try:
            frozen = any(not p.requires_grad for p in engine.module.parameters())  # not in the checkpoint
            loaded, client_state = engine.load_checkpoint(
                str(path.parent), tag=path.name, load_module_strict=not frozen
            )
            if loaded is None:
                raise FileNotFoundError("DeepSpeed found no model states")
            state = load_data(path / f"rank{dist.get_rank()}.pt")
        except UntrustedFileError as error:
            untrusted = str(error)
        except Exception as error:  # noqa: BLE001 - whatever a damaged file raises, the checkpoint is unusable
            failure = f"{path.name} (loading failed: {type(error).__name__}: {error})"
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, (failure, untrusted))
        untrusted = next((u for _, u in outcomes if u), None)
        if untrusted:  # tampered with: no older checkpoint of this directory is trusted either
            raise UntrustedFileError(
                f"resume: {untrusted}. Nothing was loaded or run; resume only run directories you made, or "
                f"pass --overwrite to start afresh"
            )
        failure = next((f for f, _ in outcomes if f), None)
        if failure:
            skipped.append(failure)
            continue
        set_rng_state(state["rng"])
        if guide is not None:
            guide.load_state_dict(state["guide"])
        if skipped and dist.get_rank() == 0:
            print(f"sage-train: resuming from {path.name}; skipped {'; '.join(skipped)}", flush=True)
        return int(client_state["step"])
    raise ConfigError(
        f"resume: no usable checkpoint in {candidates[0].parent if candidates else 'the run'}: "
        f"{'; '.join(skipped)}. Pass --overwrite instead of --resume to start afresh"
    )
