"""A study's registered endpoints: each paired difference with its crossed interval and p, the
primaries' Holm-adjusted p, and where each arm's guide is read from.

An endpoint entry of a study file is {arm, versus, k: [...]} and may say ``primary: true``: the
primaries form one family, over which Holm's step-down adjusts the p-values (`intervals.holm`), so
that the chance of any false "the difference is not zero" among them is at most 0.05 when each is
read at adjusted p < 0.05. The other endpoints (e.g. the premise) keep their unadjusted p.

`refresh(study_dir)` rewrites a committed study's study.json endpoints and study.md from its stored
counts alone (nothing is rerun): how the studies run before p-values were reported got theirs.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..safe_files import write_file
from .intervals import crossed_interval, crossed_p_value, holm

#: the training curves that show the guide, by where it acts: the loss's q (``sage/*``) or, with
#: ``kl_in_reward``, the q the advantage's KL used (``kl_in_reward/*``)
GUIDE_COLUMNS = {
    "loss": ("sage/q_mean", "sage/frac_q_gt_1"),
    "reward": ("kl_in_reward/q_mean", "kl_in_reward/frac_q_gt_1"),
}

#: a study's training table and plot: these columns, the guide's two from where each arm's guide acts
SHOWN_CURVES = ("reward", "entropy", "kl", "guide: mean q", "guide: tokens with q > 1")


def endpoint_rows(counts: dict, endpoints: list) -> list:
    """Per entry and k, the paired difference arm - versus over the seeds both have, with its
    crossed interval and two-sided p; rows of ``primary`` entries also get ``p_holm``, Holm's
    adjustment over every primary row."""
    from .report import pass_at_k_matrices

    rows = []
    for entry in endpoints:
        arm, versus = counts.get(entry["arm"], {}), counts.get(entry["versus"], {})
        seeds = sorted({int(seed) for seed in arm} & {int(seed) for seed in versus})
        for k in entry["k"]:
            row = {"arm": entry["arm"], "versus": entry["versus"], "k": k, "seeds": seeds}
            if entry.get("primary"):
                row["primary"] = True
            if seeds:
                diff = pass_at_k_matrices(arm, seeds, [k])[k] - pass_at_k_matrices(versus, seeds, [k])[k]
                row.update(crossed_interval(diff), p=crossed_p_value(diff))
            rows.append(row)
    primaries = [row for row in rows if row.get("primary")]
    for row, adjusted in zip(primaries, holm([row.get("p") for row in primaries])):
        row["p_holm"] = adjusted
    return rows


def format_p(value) -> str:
    """A p-value for a table: three significant digits, "-" for none."""
    return "-" if value is None else f"{value:.3g}"


def format_points(entry: dict, p: bool = False) -> str:
    """A difference in percentage points with its interval ("-" without one), and its p if asked."""
    if entry.get("ci_low") is None:
        return "-" if entry.get("mean") is None else f"{100 * entry['mean']:+.1f} [-]"
    text = f"{100 * entry['mean']:+.1f} [{100 * entry['ci_low']:+.1f}, {100 * entry['ci_high']:+.1f}]"
    return text + (f", p = {format_p(entry.get('p'))}" if p else "")


def guide_acts_in(spec: dict) -> str:
    """ "reward" when an arm ({"algorithm", overrides...}) trains with ``kl_in_reward``, else "loss"."""
    from ..presets import PRESETS

    preset = PRESETS.get(spec["algorithm"], {})
    return "reward" if spec.get("kl_in_reward", preset.get("kl_in_reward", False)) else "loss"


def shown_curves(report: dict) -> dict:
    """{arm: {shown column: curve}}: `SHOWN_CURVES` of each arm, its guide's from where the guide acts
    (`endpoints.GUIDE_COLUMNS`); a column the runs did not log is absent."""
    shown = {}
    for arm, metrics in report["curves"].items():
        sources = ("reward", "entropy", "kl", *GUIDE_COLUMNS[guide_acts_in(report["study"]["arms"][arm])])
        shown[arm] = {name: metrics[m] for name, m in zip(SHOWN_CURVES, sources) if m in metrics}
    return shown


def refresh(study_dir) -> dict:
    """Recompute a committed study's endpoints (intervals, p, Holm) from the counts in its study.json,
    store them there, and rewrite study.md (the plots are left as they are). Returns the report."""
    from ..environment import package_commit
    from .design import Arm, Study
    from .report import markdown

    study_dir = Path(study_dir)
    report = json.loads((study_dir / "study.json").read_text())
    spec = report["study"]
    report["endpoints"] = endpoint_rows(report["counts"], spec["endpoints"])
    report["refreshed_at_commit"] = package_commit()
    write_file(study_dir / "study.json", json.dumps(report, indent=1) + "\n")
    report = json.loads((study_dir / "study.json").read_text())
    arms = [
        Arm(name, s["algorithm"], {k: v for k, v in s.items() if k != "algorithm"}) for name, s in spec["arms"].items()
    ]
    keys = ("seeds", "baseline", "eval_n", "eval_problems", "train_config", "train", "endpoints")
    study = Study(arms=arms, out=study_dir, **{key: spec[key] for key in keys})
    write_file(study_dir / "study.md", markdown(report, study) + "\n")
    return report
