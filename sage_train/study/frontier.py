"""A study on the pass@1 / pass@k frontier: each arm's pass@1 against its pass@k, with the crossed
seeds x problems 95% interval on both axes, and each arm against a baseline by the rule "better only
if higher at pass@k without a lower pass@1".

An anchor that keeps coverage (pass@k) by giving up pass@1 has moved along the frontier, not past it,
so a difference at pass@k alone does not make an arm better. Per arm against the baseline, from the
paired differences at pass@k and at pass@1 (each "higher" or "lower" when its 95% interval excludes
zero; unadjusted, as every interval in study.md; a study's registered verdicts may adjust pass@k's):

- better: higher at pass@k, not lower at pass@1;  worse: lower at pass@k, not higher at pass@1;
- a trade: higher at pass@k and lower at pass@1, or the reverse;
- no detected difference at pass@k otherwise (the pass@1 difference still shown).

Every number comes from the study's counts (`endpoints.aggregate`), so `report.recompute` covers them.

    sage-study --frontier docs/results/confirmatory --k 64 --out DIR    # a stored study's frontier.md/png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..safe_files import make_dir, save_figure, write_file
from .design import StudyError
from .endpoints import aggregate, interval_cell

VERDICTS = ("better", "worse", "a trade", "no detected difference")


def direction(entry: dict) -> int:
    """+1 / -1 when the interval lies wholly above / below zero, else 0 (also without an interval)."""
    if entry["ci_low"] is None:
        return 0
    return 1 if entry["ci_low"] > 0 else -1 if entry["ci_high"] < 0 else 0


def verdict(diff_k: dict, diff_1: dict) -> str:
    """The frontier rule (module docstring) from the paired differences at pass@k and pass@1."""
    at_k, at_1 = direction(diff_k), direction(diff_1)
    if at_k == 0:
        return "no detected difference"
    if at_k * at_1 < 0:
        return "a trade"
    return "better" if at_k > 0 else "worse"


def frontier(counts: dict, baseline: str, k: int) -> list:
    """Per arm with counts: {"arm", "pass_at_1", "pass_at_k"} (crossed intervals), and for the other
    arms paired with the baseline "diff_1", "diff_k" and their "verdict"."""

    if baseline not in counts:
        raise StudyError(f"frontier: baseline {baseline!r} is not one of the arms {list(counts)}")
    rows = []
    for arm, result in aggregate(counts, baseline, [1, k]).items():
        if not result["pass_at_k"]:
            continue
        row = {"arm": arm, "pass_at_1": result["pass_at_k"][1], "pass_at_k": result["pass_at_k"][k]}
        if "diff_vs_baseline" in result:
            diff_1, diff_k = result["diff_vs_baseline"][1], result["diff_vs_baseline"][k]
            row.update(diff_1=diff_1, diff_k=diff_k, verdict=verdict(diff_k, diff_1))
        rows.append(row)
    return rows


def markdown_lines(rows: list, baseline: str, k: int) -> list:
    """study.md's frontier section (a table; the plot is frontier.png)."""
    lines = [
        f"## The frontier: pass@1 against pass@{k}, every arm against {baseline}",
        "",
        f"Better only if higher at pass@{k} without a lower pass@1 (each difference paired, 95% crossed "
        "interval, unadjusted; `sage_train/study/frontier.py`): a trade is a move along the frontier.",
        "",
        f"| arm | pass@1 | pass@{k} | pass@1 - {baseline} | pass@{k} - {baseline} | verdict |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        cells = [interval_cell(row["pass_at_1"]), interval_cell(row["pass_at_k"])]
        if "verdict" in row:
            cells += [interval_cell(row["diff_1"], True), interval_cell(row["diff_k"], True), row["verdict"]]
        else:
            cells += ["-", "-", "(the baseline)" if row["arm"] == baseline else "(no paired seeds)"]
        lines.append(f"| {row['arm']} | " + " | ".join(cells) + " |")
    return lines + ["", "![frontier](frontier.png)", ""]


def plot(rows: list, k: int, path: Path, title: str = "") -> None:
    """pass@k against pass@1 per arm (percent), the crossed 95% interval as a bar on each axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 5), constrained_layout=True)
    draw(ax, rows, k, title)
    save_figure(fig, path, dpi=100)
    plt.close(fig)


def draw(ax, rows: list, k: int, title: str = "") -> None:
    """`plot`'s panel on the matplotlib axes `ax` (the README's figure draws it beside the primaries)."""
    for i, row in enumerate(rows):
        x, y = row["pass_at_1"], row["pass_at_k"]
        errors = [_error(x), _error(y)]
        ax.errorbar(
            100 * x["mean"],
            100 * y["mean"],
            xerr=errors[0],
            yerr=errors[1],
            fmt="o",
            capsize=3,
            color=f"C{i % 10}",
            label=row["arm"] + (f" ({row['verdict']})" if "verdict" in row else ""),
        )
    ax.set_xlabel("held-out pass@1 (%)")
    ax.set_ylabel(f"held-out pass@{k} (%)")
    ax.set_title(title or f"pass@1 against pass@{k} (95% crossed intervals)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _error(entry: dict):
    """matplotlib's [[below], [above]] in percent; None without an interval (one seed)."""
    if entry["ci_low"] is None:
        return None
    return [[100 * (entry["mean"] - entry["ci_low"])], [100 * (entry["ci_high"] - entry["mean"])]]


def write(report: dict, out: Path, k: int | None = None, baseline: str | None = None) -> list:
    """frontier.md and frontier.png of a study's report (a study.json's content) into `out`; k
    defaults to the study's `frontier_k`, else its largest (eval_n); baseline to the study's."""
    spec = report["study"]
    k = (spec.get("frontier_k") or spec["eval_n"]) if k is None else k
    if not 1 <= k <= spec["eval_n"]:
        raise StudyError(f"--k must be in 1..eval_n={spec['eval_n']}, got {k}")
    baseline = baseline or spec["baseline"]
    rows = frontier(report["counts"], baseline, k)
    make_dir(out)
    write_file(out / "frontier.md", "\n".join(["# The frontier", "", *markdown_lines(rows, baseline, k)]))
    plot(rows, k, out / "frontier.png")
    return rows


def main(argv: list) -> int:
    """`sage-study --frontier STUDY [--k K] [--baseline ARM] [--out DIR]`: a stored study's frontier
    (STUDY: a study.json or its folder; DIR defaults to the study's folder)."""
    parser = argparse.ArgumentParser(prog="sage-study --frontier", add_help=False)
    parser.add_argument("--frontier", required=True)
    parser.add_argument("--k", type=int, default=None)
    parser.add_argument("--baseline", default=None)
    parser.add_argument("--out", default=None)
    args, rest = parser.parse_known_args(argv)
    if rest:
        raise StudyError(f"--frontier: unexpected argument(s) {rest}; known: --k, --baseline, --out")
    path = Path(args.frontier)
    path = path / "study.json" if path.is_dir() else path
    if not path.is_file():
        raise StudyError(f"--frontier: {str(path)!r} is not a study.json")
    rows = write(json.loads(path.read_text()), Path(args.out) if args.out else path.parent, args.k, args.baseline)
    for row in rows:
        print(f"sage-study: {row['arm']}: {row.get('verdict', '(baseline)')}")
    return 0
