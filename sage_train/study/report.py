"""The numbers of a `sage-study`: pass@k with confidence intervals, paired differences, training
curves, and the files study.json, study.md, pass_at_k.png and training_curves.png.

study.json keeps what every number is computed from: the correct counts of every arm, seed and
held-out problem, ``counts[arm][str(seed)] = {"n": n, "correct": [c per problem]}``, the problems
in one order (their ids in ``problems``) for every arm and seed. pass@k of a cell (seed, problem)
is the unbiased estimate from its counts (`evaluate.pass_at_k`); an arm's pass@k is the mean over
the seeds x problems matrix of these, with the crossed seeds x problems 95% interval
(`sage_train.study.intervals`: both are random factors). A difference from the baseline is paired, per
cell: the arms of one seed start from the same model and every model sees the same problems; its
interval is the crossed interval of the matrix of differences. `recompute(study.json)` rebuilds
every interval from the stored counts. With one seed there is no interval (the seed-to-seed
variance cannot be estimated from one seed); the entry's ``note`` says so.

study.json also records the environment each run was trained and evaluated in (library versions,
commit, machine; `sage_train.environment`), and per seed the warm start's SFT steps and pass@k.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..environment import LIBRARIES, package_commit
from ..report import read_metrics
from ..run_files import RUN_FILES
from ..safe_files import write_file
from ..step_metrics import STEP_METRICS
from . import frontier
from .design import START, reused_arms, reused_study
from .endpoints import (
    GUIDE_COLUMNS,
    SHOWN_CURVES,
    TRAINING_CURVES,
    aggregate,
    endpoint_rows,
    format_p,
    interval_cell,
    pass_at_k_matrices,
    shown_curves,
)
from .intervals import t_interval
from .plots import plot_curves, plot_pass_at_k

CURVE_METRICS = (
    *TRAINING_CURVES,
    *GUIDE_COLUMNS["loss"],
    *GUIDE_COLUMNS["reward"],
    STEP_METRICS.anchor_pressure,
    STEP_METRICS.guide_pressure,
)


# ----------------------------------------------------------------------------- counts and intervals


def collect_counts(study, arm_names: list) -> tuple:
    """(problems, counts) from the runs' sage-eval records: the problem ids in their evaluation
    order, and {arm: {str(seed): {"n", "correct"}}} for the (arm, seed) evaluations that finished.
    Raises ValueError when two evaluations saw other problems or another order."""
    problems, counts = None, {}
    for arm in arm_names:
        counts[arm] = {}
        for seed in study.seeds:
            results = study.run_dir(arm, seed) / RUN_FILES.study_eval / "results.json"
            if not results.is_file():
                continue
            model = next(iter(json.loads(results.read_text())["models"].values()))
            records = next(iter(model["tasks"].values()))["problems"]
            ids = [r["problem_id"] for r in records]
            if problems is None:
                problems = ids
            elif ids != problems:
                raise ValueError(f"{arm} seed {seed} was evaluated on other problems than the first evaluation")
            n = {r["n"] for r in records}
            if len(n) != 1:
                raise ValueError(f"{arm} seed {seed}: problems were sampled with different n {sorted(n)}")
            counts[arm][str(seed)] = {"n": n.pop(), "correct": [r["c"] for r in records]}
    return problems or [], counts


def reuse_counts(study, problems: list, counts: dict) -> dict:
    """Adds the reused arms' stored counts (`Study.reuse`) for the study's seeds to `counts` (after
    the start, before the arms that ran) and returns what the report records of the reuse: the
    stored study, its arms, and per seed whether the freshly evaluated start's counts equal the
    stored ones (the pairing of new and reused arms rests on it). Raises ValueError when the
    stored problems are not the ones evaluated here."""
    if not study.reuse:
        return {}
    stored = reused_study(study)
    if problems and problems != stored["problems"]:
        raise ValueError(f"reuse: {study.reuse['study']} was evaluated on other problems than this study")
    fresh_start = counts.get(START, {})
    start_identical = {seed: entry == stored["counts"][START].get(seed) for seed, entry in fresh_start.items()}
    reused = {arm: {str(s): stored["counts"][arm][str(s)] for s in study.seeds} for arm in reused_arms(study)}
    ordered = {START: reused.pop(START, fresh_start), **reused}
    ordered.update((arm, entry) for arm, entry in counts.items() if arm != START)
    counts.clear()
    counts.update(ordered)
    return {
        "study": study.reuse["study"],
        "arms": reused_arms(study),
        "problems": stored["problems"],
        "start_counts_identical": start_identical,
    }


def recompute(path) -> dict:
    """Every interval and p-value of a study.json from its stored counts (a reader's check of a
    committed study): {"arms": {arm: {"pass_at_k", "diff_vs_baseline"}} with integer k, as
    `aggregate` computes them, "endpoints": the registered endpoints with p and the primaries'
    Holm-adjusted p (`endpoints.endpoint_rows`)}."""
    report = json.loads(Path(path).read_text())
    ks = list(range(1, report["study"]["eval_n"] + 1))
    return {
        "arms": aggregate(report["counts"], report["study"]["baseline"], ks),
        "endpoints": endpoint_rows(report["counts"], report["study"].get("endpoints") or []),
    }


def warm_starts(study, counts: dict) -> dict:
    """{str(seed): {"sft_steps", "pass_at_1", "pass_at_n"}}: each seed's warm start, as its sft/
    records it (`RUN_FILES.warm_start`; None if absent) and as the study evaluated it."""

    result = {}
    for seed in study.seeds:
        path = study.run_dir(START, seed) / RUN_FILES.sft / RUN_FILES.warm_start
        entry = {"sft_steps": json.loads(path.read_text())["sft_steps"] if path.is_file() else None}
        if str(seed) in counts.get(START, {}):
            matrices = pass_at_k_matrices(counts[START], [seed], [1, study.eval_n])
            entry.update(pass_at_1=float(matrices[1].mean()), pass_at_n=float(matrices[study.eval_n].mean()))
        result[str(seed)] = entry
    return result


def environments(study, arm_names: list) -> list:
    """The distinct environments the runs were trained and evaluated in, each with the runs (and
    stage: train or eval) it produced; a run finished before environments were recorded is absent."""
    found = []
    for arm in arm_names:
        for seed in study.seeds:
            path = study.run_dir(arm, seed) / RUN_FILES.study_env
            for stage, env in (json.loads(path.read_text()) if path.is_file() else {}).items():
                match = next((e for e in found if e["environment"] == env), None)
                if match is None:
                    match = {"environment": env, "runs": []}
                    found.append(match)
                match["runs"].append(f"{arm}-s{seed}:{stage}")
    return found


def curves(study) -> dict:
    """{arm: {metric: {"step", "mean", "low", "high", "seeds"}}}: each step's mean over seeds and
    its 95% t-interval (the band); only steps every seed reached."""
    result = {}
    for arm in study.arms:
        runs = [read_metrics(p) for s in study.seeds if (p := study.run_dir(arm.name, s) / RUN_FILES.metrics).is_file()]
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


def reused_specs(study) -> dict:
    """The reused arms' specs as the stored study ran them (`Study.reuse`; the start has none),
    each marked with the study it comes from."""
    if not study.reuse:
        return {}
    stored = reused_study(study)["study"]["arms"]
    return {arm: {**stored[arm], "reused_from": study.reuse["study"]} for arm in reused_arms(study) if arm in stored}


def reused_curves(study) -> dict:
    """The stored training curves of the reused arms (`Study.reuse`; their runs are not here)."""
    if not study.reuse:
        return {}
    stored = reused_study(study).get("curves", {})
    return {arm: stored[arm] for arm in reused_arms(study) if arm in stored}


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
    problems, counts = collect_counts(study, arm_names)
    reuse = reuse_counts(study, problems, counts)
    problems = reuse.pop("problems", problems)
    report = {
        "command": "sage-study " + " ".join(argv),
        "report_commit": package_commit(),  # the code that computed the numbers below from the counts
        "environments": environments(study, arm_names),
        "wall_time_s": wall_time_s,
        "run_time_s": _run_times(study),
        "study": {
            "arms": {
                **reused_specs(study),
                **{arm.name: {"algorithm": arm.algorithm, **arm.overrides} for arm in study.arms},
            },
            "seeds": study.seeds,
            "baseline": study.baseline,
            "eval_n": study.eval_n,
            "eval_problems": study.eval_problems,
            "train_config": study.train_config,
            "train": study.train,
            "endpoints": study.endpoints,
            **({"reuse": study.reuse} if study.reuse else {}),
        },
        **({"reuse": reuse} if reuse else {}),
        "warm_starts": warm_starts(study, counts),
        "endpoints": endpoint_rows(counts, study.endpoints),
        "arms": aggregate(counts, study.baseline, list(range(1, study.eval_n + 1))),
        "curves": {**reused_curves(study), **curves(study)},
        "frontier": _frontier_verdicts(study, counts),
        "problems": problems,
        "counts": counts,
    }
    write_file(study.out / "study.json", json.dumps(report, indent=1) + "\n")
    report = json.loads((study.out / "study.json").read_text())  # string keys, as a reader sees them
    plot_pass_at_k(report, study.out / "pass_at_k.png")
    plot_curves(shown_curves(report), study.out / "training_curves.png")
    if report["frontier"]:
        frontier.plot(
            frontier.frontier(counts, study.baseline, report["frontier"]["k"]),
            report["frontier"]["k"],
            study.out / "frontier.png",
        )
    report["summary"] = summary_table(report, study)
    write_file(study.out / "study.md", markdown(report, study) + "\n")
    return report


def _frontier_verdicts(study, counts: dict) -> dict | None:
    """{"k", "baseline", "verdicts": {arm: verdict}} of the frontier view (`frontier`), None until the
    baseline has counts."""
    if not counts.get(study.baseline):
        return None
    k = study.frontier_k or study.eval_n
    rows = frontier.frontier(counts, study.baseline, k)
    return {"k": k, "baseline": study.baseline, "verdicts": {r["arm"]: r["verdict"] for r in rows if "verdict" in r}}


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


def _directions(entry: dict) -> str:
    """How many seeds' paired differences are above / below zero ("3/2")."""
    per_seed = entry["per_seed"]
    return f"{sum(d > 0 for d in per_seed)}/{sum(d < 0 for d in per_seed)}"


def summary_table(report: dict, study) -> str:
    """The console summary: pass@1 and pass@n per arm, and the paired differences."""
    n = str(study.eval_n)
    lines = [f"sage-study: held-out pass@k (%), mean [95% CI], {study.eval_problems} problems x {n} samples"]
    for row in report["endpoints"]:
        cell = interval_cell(row, sign=True) if row["seeds"] else "(no paired seeds yet)"
        test = f", p {format_p(row.get('p'))}" + (f", Holm {format_p(row.get('p_holm'))}" if row.get("primary") else "")
        lines.append(
            f"  endpoint {row['arm']} - {row['versus']} at pass@{row['k']}: {cell}{test} ({len(row['seeds'])} seeds)"
        )
    for arm, result in report["arms"].items():
        if not result["pass_at_k"]:
            lines.append(f"  {arm:24s} (no finished evaluation)")
            continue
        shown = result["pass_at_k"]
        line = f"  {arm:24s} pass@1 {interval_cell(shown['1'])}  pass@{n} {interval_cell(shown[n])}"
        if "diff_vs_baseline" in result:
            diff = result["diff_vs_baseline"]
            line += (
                f"  vs {study.baseline}: {interval_cell(diff['1'], sign=True)} / {interval_cell(diff[n], sign=True)}"
            )
        lines.append(line + f"  ({len(result['seeds'])} seeds)")
    if any(len(result["seeds"]) == 1 for result in report["arms"].values()):
        lines.append("  [-]: one seed, so no interval (how much another seed would differ is unmeasured)")
    lines.append(f"  wrote {study.out / 'study.md'}, study.json, pass_at_k.png, training_curves.png")
    return "\n".join(lines)


def _endpoint_lines(rows: list) -> list:
    """The pre-registered endpoints' table (nothing when the study registered none)."""
    if not rows:
        return []
    lines = [
        "## Pre-registered endpoints (percentage points, paired, crossed 95% interval)",
        "",
        "p: two-sided, of the t-test the crossed interval inverts. Holm: adjusted over the registered "
        "primaries (marked *), the family-wise rule; the other endpoints keep their unadjusted p.",
        "",
        "| endpoint | seeds | difference | p | Holm-adjusted p | seeds above / below |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        name = f"{row['arm']} - {row['versus']} at pass@{row['k']}" + (" *" if row.get("primary") else "")
        cells = [interval_cell(row, sign=True), format_p(row.get("p")), format_p(row.get("p_holm")), _directions(row)]
        lines.append(f"| {name} | {len(row['seeds'])} | " + " | ".join(cells if row["seeds"] else ["-"] * 4) + " |")
    return lines + [""]


def _k_table(title: str, rows: list, ks: list) -> list:
    """A markdown table: one row (name, seeds, a cell per k) per entry of `rows`."""
    header = "| algorithm | seeds | " + " | ".join(f"pass@{k}" for k in ks) + " |"
    return ["", title, "", header, "|---|---:|" + "---:|" * len(ks), *(f"| {' | '.join(row)} |" for row in rows)]


def markdown(report: dict, study) -> str:
    ks, arms = [str(k) for k in _ks_shown(study.eval_n)], report["arms"]
    lines = [
        "# sage-study",
        "",
        f"- command: `{report['command']}`; report computed at commit {report['report_commit']}"
        + (
            f"; endpoints, p-values and this file recomputed from the counts at {r}"
            if (r := report.get("refreshed_at_commit"))
            else ""
        ),
        f"- wall time: {_wall(report['wall_time_s'])}; the sage-train runs took "
        f"{report['run_time_s'] / 60:.1f} min in all (the evaluations not counted)",
        f"- held-out: {study.eval_problems} problems x {study.eval_n} samples per model; seeds {study.seeds}; "
        f"training config `{study.train_config}` with {json.dumps(study.train)}",
        f"- arms: `{START}` is the warm-started model every algorithm of a seed starts from (no RL); "
        + "; ".join(f"`{name}`: {json.dumps(spec)}" for name, spec in report["study"]["arms"].items()),
    ]
    for found in report["environments"]:
        env = found["environment"]
        versions = ", ".join(f"{key} {env[key]}" for key in ("python", *LIBRARIES))
        lines.append(
            f"- environment of {len(found['runs'])} run stage(s): commit {env['commit']}; {versions}; "
            f"{env['machine']['cpu']}, {env['machine']['cores']} cores, {env['machine']['threads']} torch thread(s)"
        )
    lines += [
        "",
        "95% intervals: crossed seeds x problems (two-way random-effects ANOVA, Satterthwaite degrees of "
        "freedom; `sage_train/study/intervals.py`), recomputable from the counts in study.json "
        "(`sage_train.study.report.recompute`). Differences are paired by seed and problem.",
        "",
        *_endpoint_lines(report["endpoints"]),
        "## Warm starts",
        "",
        f"| seed | SFT steps | held-out pass@1 | held-out pass@{study.eval_n} |",
        "|---:|---:|---:|---:|",
    ]
    for seed, start in report["warm_starts"].items():
        cells = [str(start["sft_steps"]) if start["sft_steps"] is not None else "-"]
        cells += [f"{100 * start[key]:.1f}" if key in start else "-" for key in ("pass_at_1", "pass_at_n")]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    rows = [
        [arm, str(len(r["seeds"])), *(interval_cell(r["pass_at_k"][k]) if r["pass_at_k"] else "-" for k in ks)]
        for arm, r in arms.items()
    ]
    lines += _k_table("## Held-out pass@k (%)", rows, ks)
    paired = {arm: r for arm, r in arms.items() if "diff_vs_baseline" in r}
    rows = [
        [arm, str(len(r["paired_seeds"])), *(interval_cell(r["diff_vs_baseline"][k], True) for k in ks)]
        for arm, r in paired.items()
    ]
    lines += _k_table(f"## Difference from {study.baseline} (percentage points, paired)", rows, ks)
    rows = [
        [arm, str(len(r["paired_seeds"])), *(_directions(r["diff_vs_baseline"][k]) for k in ks)]
        for arm, r in paired.items()
    ]
    lines += _k_table(f"## Seeds above / below {study.baseline} (paired difference > 0 / < 0)", rows, ks)
    if report.get("frontier"):
        spec = report["frontier"]
        rows = frontier.frontier(report["counts"], spec["baseline"], spec["k"])
        lines += ["", *frontier.markdown_lines(rows, spec["baseline"], spec["k"])]
    lines += [
        "",
        "## Training (mean over seeds; first and last 10% of steps)",
        "",
        "The guide's columns are read where it acts: the loss's `sage/*` or, for the `kl_in_reward` arms, "
        "`kl_in_reward/*` (the q of the advantage's KL; their loss has no KL, so `kl` is 0 there). "
        '"not recorded": the runs did not log it.',
        "",
        "| algorithm | " + " | ".join(SHOWN_CURVES) + " |",
        "|---|" + "---:|" * len(SHOWN_CURVES),
    ]
    for arm, metrics in shown_curves(report).items():
        cells = [
            f"{window_mean(metrics[m], False):.3f} -> {window_mean(metrics[m], True):.3f}"
            if m in metrics
            else "not recorded"
            for m in SHOWN_CURVES
        ]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += ["", "![pass@k](pass_at_k.png)", "", "![training curves](training_curves.png)"]
    return "\n".join(lines)
