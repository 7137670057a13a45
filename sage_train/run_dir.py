"""The run directory: a fresh run clears the old run's outputs; a resumed run checks its config
against the saved one and continues from the newest checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from . import checkpoint
from .config import ConfigError, TrainConfig, load_yaml, save_yaml

FRESH_RUN_CLEARS = (
    "checkpoints",
    "sft",
    "final",
    "tensorboard",
    "eval_before.json",
    "eval_after.json",
    "summary.json",
    "metrics.png",
)
RESUME_MAY_CHANGE = (
    "resume",
    "progress",
    "plots",
    "tensorboard",
    "log_every",
    "save_every",
    "keep_checkpoints",
)


def prepare_run_dir(cfg: TrainConfig, run_dir: Path, rank: int) -> Optional[int]:
    """Create `run_dir` and save the config; with ``resume`` check the config against the saved one
    and return the newest checkpoint's step (None for a fresh run, or when there is none yet)."""
    step = checkpoint.latest_step(run_dir) if cfg.resume else None
    if step is not None:
        saved = load_yaml(run_dir / "config.yaml").to_dict()
        changed = sorted(
            k for k, v in cfg.to_dict().items() if saved.get(k) != v and k not in RESUME_MAY_CHANGE
        )
        if changed:
            raise ConfigError(
                f"resume: config key(s) {changed} differ from the run's saved config.yaml "
                f"({', '.join(f'{k}: {saved.get(k)!r} -> {getattr(cfg, k)!r}' for k in changed)})"
            )
    if rank == 0:
        if step is None and run_dir.is_dir():
            stale = [run_dir / name for name in FRESH_RUN_CLEARS if (run_dir / name).exists()]
            if stale:
                print(
                    f"sage-train: starting {run_dir} afresh (pass --resume to continue it instead)",
                    flush=True,
                )
            for path in stale:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        run_dir.mkdir(parents=True, exist_ok=True)
        save_yaml(cfg, run_dir / "config.yaml")
    dist.barrier()
    return step
