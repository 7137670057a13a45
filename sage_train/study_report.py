"""The numbers of a `sage-study`: pass@k with confidence intervals, paired differences, training
curves, and the files study.json, study.md, pass_at_k.png and training_curves.png.

Intervals (95%). pass@k of an arm is the mean over seeds and held-out problems of the unbiased
per-problem estimate (`evaluate.pass_at_k`). Two sources of uncertainty are measured:
- seeds: Student's t-interval over the per-seed means (`t_interval`), the run-to-run variation;
- problems: a percentile bootstrap over the held-out problems (`bootstrap_interval`), resampling
  the same problems for every seed, the variation from which problems were drawn.
The interval reported (``ci_low``, ``ci_high``) is the wider of the two (``ci_source`` names it),
the other is kept beside it. A difference from the baseline is paired: per seed (the arms of one
seed start from the same model) and per problem (every model sees the same problems), and gets
the same two intervals. With one seed only the bootstrap is available.
"""

from __future__ import annotations

import functools
import json
import math
import platform
import statistics
import subprocess
from pathlib import Path

import numpy as np

from .evaluate import pass_at_k
from .report import read_metrics

START = "start"  # the arm name of the starting point (the warm-started model, no RL)

CURVE_METRICS = ("reward", "entropy", "kl", "sage/q_mean", "sage/frac_q_gt_1")
BOOTSTRAP_SAMPLES = 2000
SMOOTH_STEPS = 5  # the curves' plots average this many steps (the JSON keeps every step)


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (bisection on its CDF, the
    CDF by Simpson's rule on the density; no scipy)."""

    def cdf(x: float) -> float:
        log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
        steps = 2000
        h = x / steps
        total = 0.0
        for i in range(steps + 1):
            weight = 1 if i in (0, steps) else (4 if i % 2 else 2)
            total += weight * math.exp(log_c - (df + 1) / 2 * math.log1p((i * h) ** 2 / df))
        return 0.5 + total * h / 3

    low, high = 0.0, 1000.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def t_interval(values) -> tuple:
    """(low, high): the 95% t-interval of the mean of `values` (None with fewer than 2)."""
    if len(values) < 2:
        return None
    half = t_quantile(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    mean = statistics.fmean(values)
    return (mean - half, mean + half)


def bootstrap_interval(matrix: np.ndarray, seed: int = 0) -> tuple:
    """(low, high): the 95% percentile bootstrap interval of matrix.mean(), resampling its
    columns (problems) with replacement, the same columns for every row (seed)."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, matrix.shape[1], size=(BOOTSTRAP_SAMPLES, matrix.shape[1]))
    means = matrix[:, picks].mean(axis=(0, 2))
    return (float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975)))


def interval(matrix: np.ndarray) -> dict:
    """{mean, ci_low, ci_high, ci_source, ci_seeds, ci_problems, per_seed} of a seeds x problems matrix."""
    per_seed = [float(row.mean()) for row in matrix]
    seeds, problems = t_interval(per_seed), bootstrap_interval(matrix)
    widest = "seeds" if seeds is not None and seeds[1] - seeds[0] >= problems[1] - problems[0] else "problems"
    low, high = seeds if widest == "seeds" else problems
    return {
        "mean": float(matrix.mean()),
        "ci_low": low,
        "ci_high": high,
        "ci_source": widest,
        "ci_seeds": seeds,
        "ci_problems": problems,
        "per_seed": per_seed,
    }


def per_problem(counts: dict, seeds: list, k: int) -> np.ndarray:
    """seeds x problems matrix of pass@k; counts[seed] is [(problem id, n, c)] in one fixed order."""
    return np.array([[pass_at_k(n, c, k) for _, n, c in counts[seed]] for seed in seeds])


def load_counts(study, arm: str) -> dict:
    """{seed: [(problem id, n, c)]} of the seeds whose evaluation of `arm` finished."""
    counts = {}
    for seed in study.seeds:
        results = study.run_dir(arm, seed) / "study_eval" / "results.json"
        if results.is_file():
            task = next(iter(next(iter(json.loads(results.read_text())["models"].values()))["tasks"].values()))
            counts[seed] = [(r["problem_id"], r["n"], r["c"]) for r in task["problems"]]
    return counts


def aggregate(study, arm_names: list) -> dict:
    """pass@k per arm and paired differences from the baseline, k = 1 ... eval_n."""
    ks = range(1, study.eval_n + 1)
    counts = {arm: load_counts(study, arm) for arm in arm_names}
    arms = {}
    for arm in arm_names:
        seeds = sorted(counts[arm])
        if not seeds:
            arms[arm] = {"seeds": [], "pass_at_k": {}}
            continue
        matrices = {k: per_problem(counts[arm], seeds, k) for k in ks}
        arms[arm] = {
            "seeds": seeds,
            "problems": len(counts[arm][seeds[0]]),
            "pass_at_k": {k: interval(matrices[k]) for k in ks},
        }
        paired = sorted(set(seeds) & set(counts[study.baseline]))
        if arm != study.baseline and paired:
            for seed in paired:  # the pairing by problem needs the same problems in the same order
                if [p for p, _, _ in counts[arm][seed]] != [p for p, _, _ in counts[study.baseline][seed]]:
                    raise ValueError(f"{arm} and {study.baseline} (seed {seed}) were evaluated on different problems")
            arms[arm]["paired_seeds"] = paired
            arms[arm]["diff_vs_baseline"] = {
                k: interval(per_problem(counts[arm], paired, k) - per_problem(counts[study.baseline], paired, k))
                for k in ks
            }
    return arms


def curves(study) -> dict:
    """{arm: {metric: {"step", "mean", "low", "high", "seeds"}}}: each step's mean over seeds and
    its 95% t-interval (the band); only steps every seed reached."""
    result = {}
    for arm in study.arms:
        runs = [read_metrics(p) for s in study.seeds if (p := study.run_dir(arm.name, s) / "metrics.jsonl").is_file()]
        runs = [rows for rows in runs if rows]
        result[arm.name] = {}
        for metric in CURVE_METRICS:
            series = [{row["step"]: row[metric] for row in rows if metric in row} for rows in runs]
            steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
            if not steps:
                continue
            means, lows, highs = [], [], []
            for step in steps:
                values = [s[step] for s in series]
                bounds = t_interval(values) or (values[0], values[0])
                means.append(statistics.fmean(values))
                lows.append(bounds[0])
                highs.append(bounds[1])
            result[arm.name][metric] = {"step": steps, "mean": means, "low": lows, "high": highs, "seeds": len(series)}
    return result


def window_mean(curve: dict, last: bool, fraction: float = 0.1) -> float:
    """The mean over seeds of the first or last `fraction` of the steps (at least one)."""
    count = max(1, int(len(curve["mean"]) * fraction))
    values = curve["mean"][-count:] if last else curve["mean"][:count]
    return statistics.fmean(values)


# ----------------------------------------------------------------------------- the files


def write_report(study, argv: list, wall_time_s) -> dict:
    """study.json, study.md, pass_at_k.png and training_curves.png in study.out; returns the
    report with a "summary" (the console's table). wall_time_s: None for --report-only."""
    arm_names = [START, *(arm.name for arm in study.arms)]
    report = {
        "command": "sage-study " + " ".join(argv),
        "commit": _commit(),
        "machine": f"{platform.node()}: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{_cpus()} CPU cores",
        "wall_time_s": wall_time_s,
        "run_time_s": _run_times(study),
        "study": {
            "arms": {arm.name: {"algorithm": arm.algorithm, **arm.overrides} for arm in study.arms},
            "seeds": study.seeds,
            "baseline": study.baseline,
            "eval_n": study.eval_n,
            "eval_problems": study.eval_problems,
            "train_config": study.train_config,
            "train": study.train,
        },
        "arms": aggregate(study, arm_names),
        "curves": curves(study),
    }
    (study.out / "study.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_pass_at_k(report, study.out / "pass_at_k.png")
    plot_curves(report["curves"], study.out / "training_curves.png")
    report["summary"] = summary_table(report, study)
    (study.out / "study.md").write_text(markdown(report, study) + "\n")
    return report


def _commit() -> str:
    try:
        found = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=10,
        )
        return found.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _run_times(study) -> float:
    """The sage-train runs' own wall time, summed (what the grid costs on one core at a time)."""
    total = 0.0
    for path in (study.out / "runs").glob("*/summary.json"):
        total += json.loads(path.read_text()).get("wall_time_s", 0.0)
    return total


def _wall(seconds) -> str:
    return "- (--report-only)" if seconds is None else f"{seconds / 60:.1f} min for this invocation"


def _ks_shown(n: int) -> list:
    return sorted({2**i for i in range(n.bit_length()) if 2**i <= n} | {n})


def _cell(entry: dict, percent: bool = True, sign: bool = False) -> str:
    scale = 100 if percent else 1
    fmt = "+.1f" if sign else ".1f"
    return f"{scale * entry['mean']:{fmt}} [{scale * entry['ci_low']:{fmt}}, {scale * entry['ci_high']:{fmt}}]"


def summary_table(report: dict, study) -> str:
    """The console summary: pass@1 and pass@n per arm, and the paired differences."""
    n, lines = (
        study.eval_n,
        [f"sage-study: held-out pass@k (%), mean [95% CI], {study.eval_problems} problems x {study.eval_n} samples"],
    )
    for arm, result in report["arms"].items():
        if not result["pass_at_k"]:
            lines.append(f"  {arm:24s} (no finished evaluation)")
            continue
        line = f"  {arm:24s} pass@1 {_cell(result['pass_at_k'][1])}  pass@{n} {_cell(result['pass_at_k'][n])}"
        if "diff_vs_baseline" in result:
            diff = result["diff_vs_baseline"]
            line += f"  vs {study.baseline}: {_cell(diff[1], sign=True)} / {_cell(diff[n], sign=True)}"
        lines.append(line + f"  ({len(result['seeds'])} seeds)")
    lines.append(f"  wrote {study.out / 'study.md'}, study.json, pass_at_k.png, training_curves.png")
    return "\n".join(lines)


def markdown(report: dict, study) -> str:
    ks, arms = _ks_shown(study.eval_n), report["arms"]
    lines = [
        "# sage-study",
        "",
        f"- command: `{report['command']}`",
        f"- commit: {report['commit']}; machine: {report['machine']}",
        f"- wall time: {_wall(report['wall_time_s'])}; the sage-train runs took "
        f"{report['run_time_s'] / 60:.1f} min in all (the evaluations not counted)",
        f"- held-out: {study.eval_problems} problems x {study.eval_n} samples per model; seeds {study.seeds}; "
        f"training config `{study.train_config}` with {json.dumps(study.train)}",
        f"- arms: `{START}` is the warm-started model every algorithm of a seed starts from (no RL); "
        + "; ".join(f"`{name}`: {json.dumps(spec)}" for name, spec in report["study"]["arms"].items()),
        "",
        "95% intervals: the wider of a t-interval over seeds and a bootstrap over problems "
        "(sage_train/study_report.py says how). Differences are paired by seed and problem.",
        "",
        "## Held-out pass@k (%)",
        "",
        "| algorithm | seeds | " + " | ".join(f"pass@{k}" for k in ks) + " |",
        "|---|---:|" + "---:|" * len(ks),
    ]
    for arm, result in arms.items():
        cells = [_cell(result["pass_at_k"][k]) if result["pass_at_k"] else "-" for k in ks]
        lines.append(f"| {arm} | {len(result['seeds'])} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"## Difference from {study.baseline} (percentage points, paired)",
        "",
        "| algorithm | seeds | " + " | ".join(f"pass@{k}" for k in ks) + " |",
        "|---|---:|" + "---:|" * len(ks),
    ]
    for arm, result in arms.items():
        if "diff_vs_baseline" in result:
            cells = [_cell(result["diff_vs_baseline"][k], sign=True) for k in ks]
            lines.append(f"| {arm} | {len(result['paired_seeds'])} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Training (mean over seeds; first and last 10% of steps)",
        "",
        "| algorithm | " + " | ".join(CURVE_METRICS) + " |",
        "|---|" + "---:|" * len(CURVE_METRICS),
    ]
    for arm, metrics in report["curves"].items():
        cells = [
            f"{window_mean(metrics[m], False):.3f} -> {window_mean(metrics[m], True):.3f}" if m in metrics else "-"
            for m in CURVE_METRICS
        ]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += ["", "![pass@k](pass_at_k.png)", "", "![training curves](training_curves.png)"]
    return "\n".join(lines)


def plot_pass_at_k(report: dict, path: Path) -> None:
    """pass@k against k with bands (left) and the paired difference from the baseline (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    baseline, colors = report["study"]["baseline"], _colors(report["arms"])
    for arm, result in report["arms"].items():
        if not result["pass_at_k"]:
            continue
        ks = sorted(result["pass_at_k"], key=int)
        for ax, key in ((left, "pass_at_k"), (right, "diff_vs_baseline")):
            if key not in result:
                continue
            entries = [result[key][k] for k in ks]
            x = [int(k) for k in ks]
            ax.plot(x, [e["mean"] for e in entries], marker="o", markersize=3, label=arm, color=colors[arm])
            ax.fill_between(
                x, [e["ci_low"] for e in entries], [e["ci_high"] for e in entries], color=colors[arm], alpha=0.12
            )
    left.set_title("held-out pass@k (95% CI)")
    right.set_title(f"difference from {baseline}, paired (95% CI)")
    right.axhline(0.0, color="black", linewidth=0.8)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_curves(all_curves: dict, path: Path) -> None:
    """One panel per metric of `CURVE_METRICS`, a line per arm with its band, smoothed over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVE_METRICS), figsize=(4 * len(CURVE_METRICS), 3.6), constrained_layout=True)
    colors = _colors([START, *all_curves])
    for ax, metric in zip(axes, CURVE_METRICS):
        for arm, metrics in all_curves.items():
            if metric not in metrics:
                continue
            curve = metrics[metric]
            smooth = [_smooth(curve[key]) for key in ("mean", "low", "high")]
            ax.plot(curve["step"], smooth[0], label=arm, linewidth=1.2, color=colors[arm])
            ax.fill_between(curve["step"], smooth[1], smooth[2], color=colors[arm], alpha=0.12)
        ax.set_title(f"{metric} ({SMOOTH_STEPS}-step mean)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _colors(arms) -> dict:
    """One colour per arm, the same in every plot (the starting point first)."""
    return {arm: f"C{i % 10}" for i, arm in enumerate(arms)}


def _smooth(values: list) -> list:
    """Trailing mean over `SMOOTH_STEPS` steps."""
    return [statistics.fmean(values[max(0, i - SMOOTH_STEPS + 1) : i + 1]) for i in range(len(values))]
