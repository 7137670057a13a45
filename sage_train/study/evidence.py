"""The README's figure of the registered primaries of issues 38 and 49: each one's point and 95%
interval, in percentage points, with its Holm-adjusted p, read from the committed result files of
stages 0-3 (a stage without its file is left out); beside them, the frontier (pass@1 against pass@64
per arm, `frontier`) of the latest stage with per-arm counts.

    python -m sage_train.study.evidence docs/results        # writes docs/results/primaries.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..safe_files import save_figure

#: (stage label, file under docs/results, how to read its primaries)
STAGES = (
    ("stage 0: coverage toy, 30 seeds", "toy-sampled/sampled.json", "toy"),
    ("stage 1: SFT >= 1300 steps, 8 + 8 seeds", "enrichment/enrichment.json", "enrichment"),
    ("stage 2: confirmatory", "confirmatory/study.json", "study"),
    ("stage 3: the frontier, beta 0.2", "frontier/study.json", "study"),
)
FRONTIER_K = 64  # the frontier panel's pass@k: the stages' registered k


def primaries(results: Path) -> list:
    """[(stage, label, mean, low, high, p_holm)] of every committed stage's registered primaries."""
    rows = []
    for stage, name, kind in STAGES:
        path = results / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        if kind == "toy":
            entries = [(f"{r['arm']} - {r['versus']} @{r['k']}", r) for r in data["endpoints"]["primary"]]
        elif kind == "enrichment":
            entries = [(f"{name} @{data['k']}", r) for name, r in data["primary"].items()]
        else:
            entries = [(f"{r['arm']} - {r['versus']} @{r['k']}", r) for r in data["endpoints"] if r.get("primary")]
        for label, r in entries:
            if r.get("ci_low") is not None:
                rows.append((stage, label, r["mean"], r["ci_low"], r["ci_high"], r.get("p_holm")))
    return rows


def latest_frontier(results: Path) -> tuple:
    """(stage label, frontier rows at pass@`FRONTIER_K`) of the latest committed stage stored as a
    study.json (per-arm counts), or (None, []) without one."""
    from .frontier import frontier

    for stage, name, kind in reversed(STAGES):
        path = results / name
        if kind == "study" and path.is_file():
            data = json.loads(path.read_text())
            if data.get("counts"):
                baseline = data["study"]["baseline"]
                return f"{stage}, verdicts against {baseline}", frontier(data["counts"], baseline, FRONTIER_K)
    return None, []


def plot(rows: list, path: Path, frontier_stage: str | None = None, frontier_rows: list = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .frontier import draw

    height = max(0.45 * len(rows) + 1.4, 5.0 if frontier_rows else 0.0)
    if frontier_rows:
        fig, (ax, right) = plt.subplots(
            1, 2, figsize=(15, height), constrained_layout=True, gridspec_kw={"width_ratios": [3, 2]}
        )
        draw(right, frontier_rows, FRONTIER_K, f"pass@1 against pass@{FRONTIER_K} ({frontier_stage})")
    else:
        fig, ax = plt.subplots(figsize=(9, height), constrained_layout=True)
    stages = list(dict.fromkeys(row[0] for row in rows))
    for y, (stage, label, mean, low, high, p_holm) in enumerate(rows):
        color = f"C{stages.index(stage)}"
        ax.errorbar(100 * mean, y, xerr=[[100 * (mean - low)], [100 * (high - mean)]], fmt="o", color=color, capsize=3)
        ax.annotate(f"Holm p {p_holm:.3g}", (100 * high, y), xytext=(6, -3), textcoords="offset points", fontsize=7)
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [f"{row[1]}" for row in rows], fontsize=7)
    ax.invert_yaxis()
    for stage in stages:
        ax.plot([], [], "o", color=f"C{stages.index(stage)}", label=stage)
    fig.legend(
        *ax.get_legend_handles_labels(), fontsize=7, loc="outside lower center", ncols=len(stages)
    )  # below the axes: never over a row
    ax.set(xlabel="percentage points (95% interval)", title="the registered primaries (issues 38, 49)")
    ax.grid(alpha=0.3)
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    results = Path(argv[0] if argv else "docs/results")
    rows = primaries(results)
    if not rows:
        print(f"no stage's results under {results}")
        return 1
    plot(rows, results / "primaries.png", *latest_frontier(results))
    for stage, label, mean, low, high, p_holm in rows:
        print(f"{stage} | {label}: {100 * mean:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}], Holm p {p_holm:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
