"""What a run reports: ``metrics.jsonl`` (one row per step, TRL / official SAGE names), a
console progress bar, the experiment loggers of ``report_to`` (TensorBoard, W&B, trackio), plots,
and the end-of-run summary. A metric without a value at a step (NaN: the token means of a step
without completion tokens) is left out of that step's row everywhere.

Only rank 0 writes. Rows arrive already on the host: the trainer converts its metric
tensors at log intervals only.

A resumed run leaves each record with every step once: ``metrics.jsonl`` drops the rows past the
checkpoint (and a half-written last line), TensorBoard purges its events past it, and W&B (offline)
and trackio, which cannot take a step back, get a fresh record replaying the kept rows.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from sage_kernels.metrics import METRIC_NAME

from .errors import RunError
from .run_files import RUN_FILES
from .safe_files import make_dir, open_append, remove, save_figure, write_file
from .step_metrics import STEP_METRICS, WALL_CLOCK

#: the progress bar's fields: (metric name, label, format)
PROGRESS_FIELDS = (
    (STEP_METRICS.reward, "reward", ".3f"),
    (METRIC_NAME.kl, "kl", ".4f"),
    (METRIC_NAME.entropy, "H", ".3f"),
    (METRIC_NAME.q, "q", ".3f"),
    (METRIC_NAME.q_max, "q_max", ".2f"),
    (STEP_METRICS.step_time, "s/step", ".2f"),
)

#: the plots: (panel title, metric names drawn in it)
PLOT_PANELS = (
    ("reward", (STEP_METRICS.reward,)),
    ("KL to the anchor", (METRIC_NAME.kl,)),
    ("entropy (nats)", (METRIC_NAME.entropy,)),
    ("guide q", (METRIC_NAME.q, METRIC_NAME.q_min, METRIC_NAME.q_max)),
    ("share of tokens with q > 1", (STEP_METRICS.q_above_one,)),
    ("clip fractions", (METRIC_NAME.low, METRIC_NAME.high, METRIC_NAME.region)),
    ("completion length", (STEP_METRICS.mean_length,)),
)


def write_completions(path: Path, step: int, groups: list, prompt_of) -> None:
    """Append one line per group (``log_completions``): the step, problem id, prompt (`prompt_of`),
    gold answer, completion texts, rewards and finish reasons. A resumed run appends after its
    checkpoint's step, so steps past it appear twice; the later lines are the run's."""
    with open_append(path) as f:
        for group in groups:
            problem, completions = group["problem"], group["completions"]
            row = {
                "step": step,
                "problem_id": problem.id,
                "prompt": prompt_of(problem),
                "answer": problem.answer,
                "completions": [c.text for c in completions],
                "rewards": [float(r) for r in group["rewards"]],
                "finish_reasons": [c.finish_reason for c in completions],
            }
            f.write(json.dumps(row) + "\n")


class MetricsLog:
    """Appends rows to ``metrics.jsonl`` (fsynced: a checkpoint never gets ahead of its rows) and to
    the experiment loggers (`make_loggers`, set as ``loggers``). On resume it first keeps only the
    rows up to the checkpoint's step (``history``), so the file reads like an uninterrupted run's; a
    half-written last line (a kill mid-write) is dropped and said so."""

    def __init__(self, path: Path, *, resume_step: int | None = None):
        self.path = Path(path)
        kept = []
        if resume_step is not None and self.path.is_file():
            kept = rows_up_to(self.path, resume_step)
        write_file(self.path, "".join(line + "\n" for line in kept))
        self.history = [json.loads(line) for line in kept]
        self.loggers = []

    def write(self, rows: list[dict]) -> None:
        rows = [with_values_only(row) for row in rows]
        try:
            with open_append(self.path) as f:
                f.write("".join(json.dumps(row) + "\n" for row in rows))
                f.flush()
                os.fsync(f.fileno())
        except OSError as error:  # e.g. a full disk: the checkpoints so far are intact, resume drops a half line
            why = (error.strerror or str(error)).lower()
            raise RunError(f"writing {self.path} failed ({why}); continue with --resume") from error
        for logger in self.loggers:
            logger.log(rows)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def with_values_only(row: dict) -> dict:
    """`row` without its NaN entries: a metric with no value this step (e.g. the token means of a
    step without completion tokens) is left out, not logged as a number (JSON has no NaN)."""
    return {key: value for key, value in row.items() if not (isinstance(value, float) and math.isnan(value))}


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
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            if number < len(lines):  # a complete line (newline-terminated) that is not JSON: not a kill
                raise RunError(f"{path} line {number} is not JSON: {line[:80]!r}; repair or remove it") from None
            print(f"sage-train: dropped the half-written last line of {path} ({len(line)} characters)", flush=True)
            continue
        if not (isinstance(row, dict) and type(row.get("step")) is int and row["step"] >= 1):
            raise RunError(f"{path} line {number} is not a metrics row (an object with a step >= 1): {line[:80]!r}")
        if row["step"] <= step:
            by_step[row["step"]] = line  # a step logged twice (by an older version) is kept once
    missing = sorted(set(range(1, step + 1)) - set(by_step))
    if missing:
        print(f"sage-train: {path} has no row for step(s) {missing} (lost before this resume)", flush=True)
    return [by_step[s] for s in sorted(by_step)]


@dataclass(frozen=True)
class LogSettings:
    """What a run reports and where: every ``log_every`` steps to metrics.jsonl and the loggers of
    ``report_to`` (`LOGGERS`; the run ``name`` in the project ``report_project``), a progress bar, the plots at
    the end."""

    name: str
    log_every: int
    report_to: list
    report_project: str
    progress: bool
    plots: bool
    overwrite: bool  # the replaced run's record goes too (trackio)


def make_loggers(logging: LogSettings, config: dict, run_dir: Path, history: list[dict]) -> list:
    """The loggers named in ``report_to``, each given the run's `config` (its saved keys) and left
    holding exactly the steps of `history` (the rows a resumed run keeps; empty for a fresh run),
    whatever an interrupted run had sent them."""
    return [LOGGERS[name](logging, config, Path(run_dir), history) for name in logging.report_to]


class TensorBoardLogger:
    """Scalars under ``run_dir/tensorboard``, flushed at every write. A resumed run purges the events
    past its checkpoint (TensorBoard's ``purge_step``); the earlier ones are already on disk."""

    def __init__(self, logging: LogSettings, config: dict, run_dir: Path, history: list[dict]):
        from torch.utils.tensorboard import SummaryWriter

        purge = history[-1]["step"] + 1 if history else None
        self.writer = SummaryWriter(str(run_dir / RUN_FILES.tensorboard), purge_step=purge)

    def log(self, rows: list[dict]) -> None:
        for row in rows:
            for key, value in row.items():
                if key != "step":
                    self.writer.add_scalar(key, value, row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run under ``run_dir/wandb``, named after the run. Offline (``WANDB_MODE=offline``, no
    network; ``wandb sync`` uploads it later) a resumed run replaces the interrupted one's local
    record, which may lack what the killed process had not flushed, by a new one replaying `history`.
    Online it continues the same run (its id is kept in ``run_dir/wandb/run_id``) and the server
    drops the steps it already has."""

    def __init__(self, logging: LogSettings, config: dict, run_dir: Path, history: list[dict]):
        import wandb

        self.folder = make_dir(run_dir / RUN_FILES.wandb)
        id_file = self.folder / "run_id"
        offline = os.environ.get("WANDB_MODE", "") in ("offline", "dryrun")
        if history and offline:
            remove(self.folder / "wandb", quiet=True)
        if offline or not (history and id_file.is_file()):
            write_file(id_file, secrets.token_hex(4))  # wandb takes any [a-z0-9] id
        self.run = wandb.init(
            project=logging.report_project,
            name=logging.name,
            id=id_file.read_text(),
            dir=str(self.folder),
            config=config,
            resume="allow",
        )
        if offline:
            self.log(history)

    def log(self, rows: list[dict]) -> None:
        for row in rows:
            self.run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def close(self) -> None:
        self.run.finish()


class TrackioLogger:
    """A trackio run named after the run, in the project ``report_project`` (local: $TRACKIO_DIR;
    ``trackio show`` opens it). A resumed run deletes the interrupted one's record and replays
    `history`, so the record holds each step once, as ``metrics.jsonl`` does; ``overwrite`` deletes
    the replaced run's record."""

    def __init__(self, logging: LogSettings, config: dict, run_dir: Path, history: list[dict]):
        import trackio

        if history or logging.overwrite:  # this run's record replaces the interrupted (or overwritten) one's
            try:
                runs = list(trackio.Api().runs(logging.report_project))
            except ValueError:  # no such project yet
                runs = []
            for run in runs:
                if run.name == logging.name:
                    run.delete()
        self.run = trackio.init(
            project=logging.report_project,
            name=logging.name,
            config=config,
            embed=False,  # no dashboard server from a training job
            auto_log_cpu=False,  # its system-metrics rows would interleave with the steps
            auto_log_gpu=False,
        )
        self.log(history)

    def log(self, rows: list[dict]) -> None:
        for row in rows:
            self.run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def close(self) -> None:
        self.run.finish()


#: the experiment loggers ``report_to`` may name, and the class that writes to each
LOGGERS = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "trackio": TrackioLogger}


def without_timing(row: dict) -> dict:
    """A metrics row without its wall-clock keys (`step_metrics.WALL_CLOCK`): what two runs of the same
    config must log alike."""
    return {key: value for key, value in row.items() if key not in WALL_CLOCK}


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def progress_bar(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="RL", unit="step", disable=not enabled, dynamic_ncols=True)


def progress_postfix(row: dict) -> str:
    row = with_values_only(row)
    return " ".join(f"{label}={row[name]:{fmt}}" for name, label, fmt in PROGRESS_FIELDS if name in row)


def reward_trend(rows: list[dict], fraction: float = 0.1) -> dict:
    """Mean training reward of the first and of the last `fraction` of steps (at least one each)."""
    rewards = [row[STEP_METRICS.reward] for row in rows if STEP_METRICS.reward in row]
    if not rewards:
        return {"reward_first": math.nan, "reward_last": math.nan}
    count = max(1, int(len(rewards) * fraction))
    return {
        "reward_first": sum(rewards[:count]) / count,
        "reward_last": sum(rewards[-count:]) / count,
        "reward_window_steps": count,
    }


def plot_metrics(rows: list[dict], path: Path, evals: dict | None = None) -> Path | None:
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
    save_figure(fig, Path(path), dpi=110)
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
