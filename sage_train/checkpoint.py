"""Save and resume a run exactly.

A checkpoint is ``runs/<name>/checkpoints/step<N>/``: DeepSpeed's own files (model,
optimizer and LR-scheduler states, partitioned as the ZeRO stage partitions them), the
resolved ``config.yaml``, and one ``rank<r>.pt`` per process with what DeepSpeed does not
keep: the Python, NumPy and torch RNG states and the guide's state (its schedule position
and, for the random guide, its generator). The data position is the step number itself:
the trainer draws each step's prompts from a generator seeded by (seed, step), so
resuming at step N draws what an uninterrupted run would have drawn.
``checkpoints/latest`` (written by DeepSpeed) names the newest one.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from .config import save_yaml

TAG_PREFIX = "step"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


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


def save(engine, run_dir: Path, step: int, cfg, guide, *, keep: int) -> Path:
    """Write checkpoint `step` from every rank (a collective call), then drop all but the
    newest `keep` (0 keeps all)."""
    root = checkpoint_dir(run_dir)
    tag = f"{TAG_PREFIX}{step:06d}"
    engine.save_checkpoint(str(root), tag=tag, client_state={"step": step})
    rank = dist.get_rank()
    torch.save(
        {"rng": rng_state(), "guide": guide.state_dict() if guide is not None else None},
        root / tag / f"rank{rank}.pt",
    )
    if rank == 0:
        save_yaml(cfg, root / tag / "config.yaml")
        if keep:
            for old in sorted(root.glob(f"{TAG_PREFIX}*"))[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return root / tag


def latest_step(run_dir: Path) -> Optional[int]:
    """The step of the newest checkpoint in `run_dir`, or None."""
    latest = checkpoint_dir(run_dir) / "latest"
    if not latest.is_file():
        return None
    return int(latest.read_text().strip()[len(TAG_PREFIX) :])


def load(engine, run_dir: Path, guide) -> int:
    """Restore the newest checkpoint into `engine`, the RNGs and `guide`; returns its step."""
    root = checkpoint_dir(run_dir)
    step = latest_step(run_dir)
    if step is None:
        raise FileNotFoundError(f"resume: no checkpoint in {root} (no 'latest' file)")
    tag = f"{TAG_PREFIX}{step:06d}"
    path, client_state = engine.load_checkpoint(str(root), tag=tag)
    if path is None:
        raise FileNotFoundError(f"resume: DeepSpeed could not load checkpoint {root / tag}")
    state = torch.load(root / tag / f"rank{dist.get_rank()}.pt", weights_only=False)
    set_rng_state(state["rng"])
    if guide is not None:
        guide.load_state_dict(state["guide"])
    return int(client_state["step"])
