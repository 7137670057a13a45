"""The plots of a `sage-study` (pass_at_k.png, training_curves.png), drawn from its report."""

from __future__ import annotations

import statistics
from pathlib import Path

from ..safe_files import save_figure
from .design import START
from .endpoints import SHOWN_CURVES

SMOOTH_STEPS = 5  # the curves' plots average this many steps (the JSON keeps every step)


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
            if all(e["ci_low"] is not None for e in entries):  # one seed: no band
                low, high = [e["ci_low"] for e in entries], [e["ci_high"] for e in entries]
                ax.fill_between(x, low, high, color=colors[arm], alpha=0.12)
    left.set_title("held-out pass@k (95% CI)")
    right.set_title(f"difference from {baseline}, paired (95% CI)")
    right.axhline(0.0, color="black", linewidth=0.8)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, dpi=100)
    plt.close(fig)


def plot_curves(all_curves: dict, path: Path) -> None:
    """One panel per column of `SHOWN_CURVES` (`shown_curves`), a line per arm with its band,
    smoothed over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHOWN_CURVES), figsize=(4 * len(SHOWN_CURVES), 3.6), constrained_layout=True)
    colors = _colors([START, *all_curves])
    for ax, metric in zip(axes, SHOWN_CURVES):
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
    save_figure(fig, path, dpi=90)
    plt.close(fig)


def _colors(arms) -> dict:
    """One colour per arm, the same in every plot (the starting point first)."""
    return {arm: f"C{i % 10}" for i, arm in enumerate(arms)}


def _smooth(values: list) -> list:
    """Trailing mean over `SMOOTH_STEPS` steps."""
    return [statistics.fmean(values[max(0, i - SMOOTH_STEPS + 1) : i + 1]) for i in range(len(values))]
