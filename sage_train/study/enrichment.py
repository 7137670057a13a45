"""Stage 1's test of the enrichment rule: do the seeds whose SFT warm start took long lose pass@64
under GRPO? (docs/results/enrichment/PREREGISTRATION.md)

From a `sage-study` study.json with the arms `start` and `grpo` (its counts, and each seed's SFT
steps in ``warm_starts``), with seeds "long" when SFT took at least `LONG` steps:

- P1, the long seeds' premise: grpo - start at pass@64 over the long seeds, paired by seed and
  problem, with the crossed seeds x problems interval and its p (`intervals.crossed_p_value`);
- P2, the enrichment: the long seeds' mean of that difference minus the short seeds', each seed's
  difference averaged over the problems, Welch's interval and p over the seeds (the problems are the
  same for both groups, so their effects cancel in the difference);
- Holm over P1 and P2; then, read with them, the short seeds' premise, every seed's, and the
  correlation of SFT steps with each seed's difference.

    python -m sage_train.study.enrichment DIR/study.json     # writes enrichment.json and enrichment.md beside it

`recompute(study.json)` returns what enrichment.json stores, from the counts alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from ..safe_files import write_file
from .design import START
from .endpoints import format_p, format_points, pass_at_k_matrices
from .intervals import crossed_interval, crossed_p_value, holm, welch

LONG = 1300  # SFT steps at or above which a seed is "long" (the rule's threshold)
K = 64  # the registered endpoint's k
KS = (1, 64, 256)  # the premise is also read at these (secondary)


def premise(counts: dict, seeds: list, k: int) -> dict:
    """grpo - start at pass@k over `seeds`: the crossed interval, its p and the per-seed means."""
    if len(seeds) == 0:
        return {"seeds": [], "mean": None}
    diff = pass_at_k_matrices(counts["grpo"], seeds, [k])[k] - pass_at_k_matrices(counts[START], seeds, [k])[k]
    return {"seeds": seeds, **crossed_interval(diff), "p": crossed_p_value(diff)}


def analyse(report: dict, long: int = LONG) -> dict:
    counts = report["counts"]
    seeds = sorted(int(s) for s in counts["grpo"] if s in counts[START])
    sft = {s: report["warm_starts"][str(s)]["sft_steps"] for s in seeds}
    groups = {"long": [s for s in seeds if sft[s] >= long], "short": [s for s in seeds if sft[s] < long]}
    p1 = premise(counts, groups["long"], K)
    each = premise(counts, seeds, K)["per_seed"]
    per_seed = dict(zip(seeds, each))
    try:
        p2 = welch([per_seed[s] for s in groups["long"]], [per_seed[s] for s in groups["short"]])
    except ValueError as error:
        p2 = {"mean": None, "p": None, "note": str(error)}
    adjusted = holm([p1.get("p"), p2.get("p")])
    p1["p_holm"], p2["p_holm"] = adjusted
    read_with = {
        f"{group} seeds, pass@{k}": premise(counts, members, k) for group, members in groups.items() for k in KS
    }
    read_with.update({f"all seeds, pass@{k}": premise(counts, seeds, k) for k in KS})
    values = np.array([per_seed[s] for s in seeds])
    steps = np.array([sft[s] for s in seeds], dtype=np.float64)
    return {
        "long_at_least": long,
        "k": K,
        "sft_steps": {str(s): sft[s] for s in seeds},
        "groups": groups,
        "primary": {"P1 long seeds: grpo - start": p1, "P2 long - short: grpo - start": p2},
        "read_with": read_with,
        "pearson_sft_steps_vs_premise": float(np.corrcoef(steps, values)[0, 1]) if len(seeds) > 2 else None,
        "spearman_sft_steps_vs_premise": _spearman(steps, values) if len(seeds) > 2 else None,
    }


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson's correlation of the ranks (ties get their mean rank)."""

    def ranks(v):
        order = v.argsort(kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=np.float64)
        for value in np.unique(v):
            r[v == value] = r[v == value].mean()
        return r

    return float(np.corrcoef(ranks(x), ranks(y))[0, 1])


def recompute(path) -> dict:
    """The analysis of a study.json from its counts and warm starts (what enrichment.json stores)."""
    return analyse(json.loads(Path(path).read_text()))


def markdown(result: dict) -> str:
    lines = [
        "# Stage 1: the enrichment rule",
        "",
        f"Seeds long (SFT >= {result['long_at_least']} steps): {result['groups']['long']}; "
        f"short: {result['groups']['short']}. SFT steps: {json.dumps(result['sft_steps'])}.",
        "",
        "Percentage points of held-out pass@k, grpo - start paired by seed and problem.",
        "",
        "| registered primary (Holm over both) | difference [95% interval] | p | Holm-adjusted p |",
        "|---|---:|---:|---:|",
    ]
    for name, entry in result["primary"].items():
        tests = f"{format_p(entry.get('p'))} | {format_p(entry['p_holm'])}"
        lines.append(f"| {name} at pass@{result['k']} | {format_points(entry)} | {tests} |")
    lines += ["", "| read with them (unadjusted p) | difference [95% interval] | p | seeds |", "|---|---:|---:|---:|"]
    for name, entry in result["read_with"].items():
        lines.append(f"| {name} | {format_points(entry)} | {format_p(entry.get('p'))} | {len(entry['seeds'])} |")
    lines += [
        "",
        f"Correlation of SFT steps with each seed's grpo - start at pass@{result['k']}: Pearson "
        f"{format_p(result['pearson_sft_steps_vs_premise'])}, "
        f"Spearman {format_p(result['spearman_sft_steps_vs_premise'])}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m sage_train.study.enrichment DIR/study.json")
        return 2
    path = Path(argv[0])
    result = recompute(path)
    write_file(path.parent / "enrichment.json", json.dumps(result, indent=1) + "\n")
    write_file(path.parent / "enrichment.md", markdown(result) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
