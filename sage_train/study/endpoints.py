"""A study's registered endpoints: each paired difference with its crossed interval and p, the
primaries' Holm-adjusted p, the pass@k matrices they are taken from (and every arm's intervals from
them: `aggregate`), and where each arm's guide is read from.

An endpoint entry of a study file is {arm, versus, k: [...]} and may say ``primary: true``: the
primaries form one family, over which Holm's step-down adjusts the p-values (`intervals.holm`), so
that the chance of any false "the difference is not zero" among them is at most 0.05 when each is
read at adjusted p < 0.05. The other endpoints (e.g. the premise) keep their unadjusted p.
"""

from __future__ import annotations

import numpy as np

from sage_kernels.metrics import METRIC_NAME

from ..eval.evaluate import pass_at_k_table
from ..step_metrics import STEP_METRICS
from .intervals import crossed_interval, crossed_p_value, holm

#: the training curves that show the guide, by where it acts: the loss's q (``sage/*``) or, with
#: ``kl_in_reward``, the q the advantage's KL used (``kl_in_reward/*``)
GUIDE_COLUMNS = {
    "loss": (METRIC_NAME.q, STEP_METRICS.q_above_one),
    "reward": (STEP_METRICS.reward_q_mean, STEP_METRICS.reward_q_above_one),
}
#: the training curves every arm shows, before its guide's two
TRAINING_CURVES = (STEP_METRICS.reward, METRIC_NAME.entropy, METRIC_NAME.kl)

#: a study's training table and plot: these columns, the guide's two from where each arm's guide acts
SHOWN_CURVES = ("reward", "entropy", "kl", "guide: mean q", "guide: tokens with q > 1")


def pass_at_k_matrices(entry: dict, seeds: list, ks: list) -> dict:
    """{k: seeds x problems matrix of pass@k} of one arm's counts (`counts[arm]`)."""
    n = {entry[str(seed)]["n"] for seed in seeds}
    if len(n) != 1:
        raise ValueError(f"seeds {seeds} were sampled with different n {sorted(n)}")
    table = pass_at_k_table(n.pop(), ks)
    correct = np.array([entry[str(seed)]["correct"] for seed in seeds])
    return {k: table[i][correct] for i, k in enumerate(ks)}


def endpoint_rows(counts: dict, endpoints: list) -> list:
    """Per entry and k, the paired difference arm - versus over the seeds both have, with its
    crossed interval and two-sided p; rows of ``primary`` entries also get ``p_holm``, Holm's
    adjustment over every primary row."""
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
        sources = (*TRAINING_CURVES, *GUIDE_COLUMNS[guide_acts_in(report["study"]["arms"][arm])])
        shown[arm] = {name: metrics[m] for name, m in zip(SHOWN_CURVES, sources) if m in metrics}
    return shown


def aggregate(counts: dict, baseline: str, ks: list) -> dict:
    """{arm: {"seeds", "problems", "pass_at_k": {k: interval}, and for arms paired with the
    baseline "paired_seeds", "diff_vs_baseline": {k: interval}}} from stored counts; an interval
    is `intervals.crossed_interval`'s dict."""
    arms = {}
    for arm, entry in counts.items():
        seeds = sorted(int(seed) for seed in entry)
        if not seeds:
            arms[arm] = {"seeds": [], "pass_at_k": {}}
            continue
        matrices = pass_at_k_matrices(entry, seeds, ks)
        arms[arm] = {
            "seeds": seeds,
            "problems": len(entry[str(seeds[0])]["correct"]),
            "pass_at_k": {k: crossed_interval(matrices[k]) for k in ks},
        }
        paired = sorted(set(seeds) & {int(seed) for seed in counts.get(baseline, {})})
        if arm != baseline and paired:
            own, base = pass_at_k_matrices(entry, paired, ks), pass_at_k_matrices(counts[baseline], paired, ks)
            arms[arm]["paired_seeds"] = paired
            arms[arm]["diff_vs_baseline"] = {k: crossed_interval(own[k] - base[k]) for k in ks}
    return arms


def interval_cell(entry: dict, sign: bool = False) -> str:
    """A mean and its interval in percent ("-" for the interval when there is none: one seed)."""
    fmt = "+.1f" if sign else ".1f"
    if entry["ci_low"] is None:
        return f"{100 * entry['mean']:{fmt}} [-]"
    return f"{100 * entry['mean']:{fmt}} [{100 * entry['ci_low']:{fmt}}, {100 * entry['ci_high']:{fmt}}]"
