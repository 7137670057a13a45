"""What a run reports: ``metrics.jsonl`` (one row per step, TRL / official SAGE names), a
console progress bar, the experiment loggers of ``report_to`` (TensorBoard, W&B, trackio), plots,
and the end-of-run summary.

Only rank 0 writes. Rows arrive already on the host: the trainer converts its metric
tensors at log intervals only.

A resumed run continues each record without duplicating a step: ``metrics.jsonl`` drops the rows
past the checkpoint (and a half-written last line), TensorBoard purges its events past it, and
W&B / trackio, which cannot take a step back, are sent only the steps they have not received.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional

from .distributed import RunError

#: the progress bar's fields: (metric name, label, format)
PROGRESS_FIELDS = (
    ("reward", "reward", ".3f"),
    ("kl", "kl", ".4f"),
    ("entropy", "H", ".3f"),
    ("sage/q_mean", "q", ".3f"),
    ("sage/q_max", "q_max", ".2f"),
    ("step_time", "s/step", ".2f"),
)

#: the plots: (panel title, metric names drawn in it)
PLOT_PANELS = (
    ("reward", ("reward",)),
    ("KL to the anchor", ("kl",)),
    ("entropy (nats)", ("entropy",)),
    ("guide q", ("sage/q_mean", "sage/q_min", "sage/q_max")),
    ("clip fractions", ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")),
    ("completion length", ("completions/mean_length",)),
)


class MetricsLog:
    """Appends rows to ``metrics.jsonl`` (fsynced: a checkpoint never gets ahead of its rows) and to
    `loggers`. On resume it first keeps only the rows up to the checkpoint's step, so the file reads
    like an uninterrupted run's; a half-written last line (a kill mid-write) is dropped and said so."""

    def __init__(self, path: Path, *, resume_step: Optional[int] = None, loggers: tuple = ()):
        self.path = Path(path)
        if resume_step is None or not self.path.is_file():
            self.path.write_text("")
        else:
            kept = rows_up_to(self.path, resume_step)
            self.path.with_suffix(".tmp").write_text("".join(line + "\n" for line in kept))
            os.replace(self.path.with_suffix(".tmp"), self.path)
        self.loggers = list(loggers)

    def write(self, rows: list[dict]) -> None:
        with open(self.path, "a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
            f.flush()
            os.fsync(f.fileno())
        for logger in self.loggers:
            logger.log(rows)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def rows_up_to(path: Path, step: int) -> list[str]:
    """The lines of ``metrics.jsonl`` with steps 1..`step`, each once; a last line that is not JSON
    (written in part) is dropped with a message, any other one is an error naming it."""
    lines = path.read_text().split("\n")
    by_step = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if number < len(lines):  # a complete line (newline-terminated) that is not JSON: not a kill
                raise RunError(f"{path} line {number} is not JSON: {line[:80]!r}; repair or remove it") from None
            print(f"sage-train: dropped the half-written last line of {path} ({len(line)} characters)", flush=True)
            continue
        if row["step"] <= step:
            by_step[row["step"]] = line  # a step logged twice (by an older version) is kept once
    missing = sorted(set(range(1, step + 1)) - set(by_step))
    if missing:
        print(f"sage-train: {path} has no row for step(s) {missing} (lost before this resume)", flush=True)
    return [by_step[s] for s in sorted(by_step)]


def make_loggers(names: list, folder: Path, *, project: str, run_name: str, config: dict, resume_step: int) -> list:
    """The loggers named in ``report_to``, writing under `folder` (the run directory) where the logger
    lets them choose (TensorBoard, W&B; trackio writes to its own $TRACKIO_DIR)."""
    makers = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "trackio": TrackioLogger}
    return [makers[name](folder, project, run_name, config, resume_step) for name in names]


class TensorBoardLogger:
    """Scalars under ``run_dir/tensorboard``; a resumed run purges the events past its checkpoint."""

    def __init__(self, folder: Path, project: str, run_name: str, config: dict, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        purge = resume_step + 1 if resume_step else None  # hides the events past the checkpoint
        self.writer = SummaryWriter(str(Path(folder) / "tensorboard"), purge_step=purge)

    def log(self, rows: list[dict]) -> None:
        for row in rows:
            for key, value in row.items():
                if key != "step":
                    self.writer.add_scalar(key, value, row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _StepOnceLogger:
    """A logger whose history cannot go back a step: ``run_dir/<kind>/last_step`` records the last step
    it was sent, and a resumed run sends it only later ones (the earlier values stay, identical when
    the resume is exact). The run's id in ``run_dir/<kind>/run_id`` makes the resumed run the same run."""

    kind = ""

    def __init__(self, folder: Path, project: str, run_name: str, config: dict, resume_step: int):
        self.folder = Path(folder) / self.kind
        self.folder.mkdir(parents=True, exist_ok=True)
        last = self.folder / "last_step"
        self.sent = int(last.read_text()) if resume_step and last.is_file() else 0
        self.run = self.start(project, run_name, config, resumed=bool(resume_step))

    def log(self, rows: list[dict]) -> None:
        for row in rows:
            if row["step"] > self.sent:
                self.send({k: v for k, v in row.items() if k != "step"}, row["step"])
                self.sent = row["step"]
        (self.folder / "last_step").write_text(str(self.sent))


class WandbLogger(_StepOnceLogger):
    """A W&B run in ``run_dir/wandb`` (``WANDB_MODE=offline`` logs without a network; `wandb sync` uploads)."""

    kind = "wandb"

    def start(self, project: str, run_name: str, config: dict, *, resumed: bool):
        import wandb

        id_file = self.folder / "run_id"
        if not (resumed and id_file.is_file()):
            id_file.write_text(wandb.util.generate_id())
        return wandb.init(
            project=project, name=run_name, id=id_file.read_text(), dir=str(self.folder), config=config, resume="allow"
        )

    def send(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioLogger(_StepOnceLogger):
    """A trackio run (local: in $TRACKIO_DIR, ``trackio show`` opens it), named after the run."""

    kind = "trackio"

    def start(self, project: str, run_name: str, config: dict, *, resumed: bool):
        import trackio

        return trackio.init(
            project=project, name=run_name, config=config, resume="allow" if resumed else "never", embed=False
        )

    def send(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def progress_bar(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="RL", unit="step", disable=not enabled, dynamic_ncols=True)


def progress_postfix(row: dict) -> str:
    return " ".join(f"{label}={row[name]:{fmt}}" for name, label, fmt in PROGRESS_FIELDS if name in row)


def reward_trend(rows: list[dict], fraction: float = 0.1) -> dict:
    """Mean training reward of the first and of the last `fraction` of steps (at least one each)."""
    rewards = [row["reward"] for row in rows if "reward" in row]
    if not rewards:
        return {"reward_first": math.nan, "reward_last": math.nan}
    count = max(1, int(len(rewards) * fraction))
    return {
        "reward_first": sum(rewards[:count]) / count,
        "reward_last": sum(rewards[-count:]) / count,
        "reward_window_steps": count,
    }


def plot_metrics(rows: list[dict], path: Path) -> Optional[Path]:
    """One figure with a panel per entry of `PLOT_PANELS` against the step; None without rows."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    steps = [row["step"] for row in rows]
    for ax, (title, names) in zip(axes.flat, PLOT_PANELS):
        for name in names:
            values = [row.get(name, math.nan) for row in rows]
            ax.plot(steps, values, label=name, linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        if len(names) > 1:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def format_summary(summary: dict) -> str:
    """The console summary of a finished run."""
    lines = [
        f"run {summary['name']} ({summary['algorithm']}): {summary['steps_done']} RL steps, "
        f"{summary['wall_time_s']:.0f} s",
        f"  training reward: first {summary['reward_first']:.3f} -> last {summary['reward_last']:.3f} "
        f"(mean over {summary.get('reward_window_steps', 0)} steps each)",
    ]
    for when in ("before", "after"):
        for split, result in (summary.get(f"eval_{when}") or {}).items():
            scores = ", ".join(
                f"{key} {value:.3f}" for key, value in result.items() if key.startswith("pass@")
            )
            lines.append(
                f"  eval {when} RL, {split} ({result['problems']} problems x {result['samples']} samples): "
                f"{scores}"
            )
    lines.append(f"  outputs: {summary['run_dir']} (final model: {summary.get('final_model', '-')})")
    return "\n".join(lines)
