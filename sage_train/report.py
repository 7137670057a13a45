"""What a run reports: ``metrics.jsonl`` (one row per step, TRL / official SAGE names), a
console progress bar, optional TensorBoard, plots, and the end-of-run summary.

Only rank 0 writes. Rows arrive already on the host: the trainer converts its metric
tensors at log intervals only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

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
    ("share of tokens with q > 1", ("sage/frac_q_gt_1",)),
    ("clip fractions", ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")),
    ("completion length", ("completions/mean_length",)),
)


class MetricsLog:
    """Appends rows to ``metrics.jsonl``; on resume, first drops rows past the checkpoint's step
    (written after it by the interrupted run), so the file reads like an uninterrupted run's."""

    def __init__(
        self, path: Path, *, resume_step: Optional[int] = None, tensorboard_dir: Optional[Path] = None
    ):
        self.path = Path(path)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.is_file():
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= resume_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.tensorboard = _tensorboard_writer(tensorboard_dir) if tensorboard_dir else None

    def write(self, rows: list[dict]) -> None:
        with open(self.path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
                if self.tensorboard is not None:
                    for key, value in row.items():
                        if key != "step" and isinstance(value, (int, float)):
                            self.tensorboard.add_scalar(key, value, row["step"])
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def _tensorboard_writer(folder: Path):
    """A SummaryWriter when the tensorboard package is installed, else None (it is optional)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(folder))


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


def plot_metrics(rows: list[dict], path: Path, evals: Optional[dict] = None) -> Optional[Path]:
    """One figure: first pass@k before and after RL (``evals``: {"before": eval_before.json's
    content, "after": ...}; held-out first), then a panel per entry of `PLOT_PANELS` against the
    step. None without rows."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(19, 8), constrained_layout=True)
    _plot_evals(axes.flat[0], evals or {})
    steps = [row["step"] for row in rows]
    for ax, (title, names) in zip(list(axes.flat)[1:], PLOT_PANELS):
        for name in names:
            values = [row.get(name, math.nan) for row in rows]
            ax.plot(steps, values, label=name, linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        if len(names) > 1:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[1 + len(PLOT_PANELS) :]:
        ax.set_visible(False)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _plot_evals(ax, evals: dict) -> None:
    """Bars of pass@k before / after RL, held-out ("test") before the RL prompts ("train")."""
    before, after = evals.get("before") or {}, evals.get("after") or {}
    splits = sorted(set(before) | set(after), key=lambda s: s != "test")
    labels, pairs = [], []
    for split in splits:
        keys = [k for k in (before.get(split) or after.get(split)) if k.startswith("pass@")]
        for key in keys:
            labels.append(f"{'held-out' if split == 'test' else split}\n{key}")
            pairs.append(tuple((e.get(split) or {}).get(key, math.nan) for e in (before, after)))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], [p[0] for p in pairs], width=0.4, label="before RL")
    ax.bar([i + 0.2 for i in x], [p[1] for p in pairs], width=0.4, label="after RL")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_title("pass@k before / after RL")
    ax.grid(alpha=0.3, axis="y")
    if labels:
        ax.legend(fontsize=8)


def format_summary(summary: dict) -> str:
    """The console summary of a finished run: held-out pass@k before -> after RL first (what RL is
    for), then the RL prompts' own, then the training reward."""
    lines = [
        f"run {summary['name']} ({summary['algorithm']}): {summary['steps_done']} RL steps, "
        f"{summary['wall_time_s']:.0f} s"
    ]
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    labels = {"test": "held-out problems", "train": "RL prompts"}
    for split in sorted(set(before) | set(after), key=lambda s: s != "test"):
        first = before.get(split) or after[split]
        scores = []
        for key in (k for k in first if k.startswith("pass@")):
            if split in before and split in after:
                old, new = before[split][key], after[split][key]
                scores.append(f"{key} {old:.3f} -> {new:.3f} ({new - old:+.3f})")
            else:
                scores.append(f"{key} {first[key]:.3f} ({'before' if split in before else 'after'} RL)")
        lines.append(
            f"  {labels.get(split, split)} ({split}, {first['problems']} problems x {first['samples']} samples): "
            + ", ".join(scores)
        )
    lines.append(
        f"  training reward: first {summary['reward_first']:.3f} -> last {summary['reward_last']:.3f} "
        f"(mean over {summary.get('reward_window_steps', 0)} steps each)"
    )
    lines.append(f"  outputs: {summary['run_dir']} (final model: {summary.get('final_model', '-')})")
    return "\n".join(lines)
