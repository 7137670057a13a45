"""The coverage toy trained with sampled groups: where the KL is placed against how much of it.

The coverage toy (`sage_train.study.toy.coverage`: 32 prompts sharing one policy table, 8 of them
hard) trained as `sage-train` trains, not in expectation: each step draws G = 8 completions per
prompt from the current policy, takes the trainer's group advantages (std-normalised; under
``kl_in_reward`` the trainer's `advantages_of_j`, J's gradient) and makes one on-policy Adam step at
a constant rate (way (c) of `sage_train.study.toy.tabular`). Every arm of a seed draws from a generator
seeded with that seed. At the end every quantity is exact again: P(correct) of every prompt under
the final policy, hence exact pass@k up to 1024.

The arms (`arms`): GRPO at beta 0.05, at 1.4 x beta, at beta x the active guide's mean q at the
start ("the same amount of KL", beta-matched) and without KL; the branch guide in the loss at the
paper's settings (gamma 0.3, tau 1.2) and an active one (tau at the start's median token entropy,
gamma so that q reaches q_max at its 90% quantile); the KL in the advantage without a guide
(grpo-kl-in-reward) and with the active guide (sage-branch-exact). Token entropies are weighted by
how often pi_ref visits each prefix, as the trainer's sampled tokens weigh them.

A seed's value of an arm is its exact pass@k averaged over the 32 prompts; a difference is paired
by seed, with a t-interval over seeds and its two-sided p (the prompts are the whole task, not a
draw: their averaging is exact). The registered primaries get Holm-adjusted p-values
(`intervals.holm`); `recompute(sampled.json)` rebuilds every interval and p from the stored
per-(arm, seed, prompt) P(correct).

    python -m sage_train.study.toy.sampled --out DIR --seeds 5000-5029 --jobs 2   # resumable
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
import torch

from ...safe_files import make_dir, save_figure, write_file
from ..endpoints import format_points
from ..intervals import holm, t_test
from . import enumerable as E
from .coverage import coverage_options
from .tabular import KS, Options, Toy, sampled_step, train

REFERENCE = "pi_ref"  # the starting policy's row: the same exact P(correct) for every seed
PAPER = {"gamma": 0.3, "tau": 1.2}  # the package's defaults (sage_kernels.LossConfig), the paper's
MEDIAN, TOP = 0.5, 0.9  # the active guide: tau at this entropy quantile, q_max reached at that one
WINDOW = 0.1  # the guide's activity is reported over the first and the last tenth of the steps

#: the registered endpoints (docs/results/toy-sampled/PREREGISTRATION.md): the primaries, then the
#: premise and the other contrasts it is read with (reported with unadjusted p, no claim of their own)
PRIMARY = [{"arm": "sage-branch-active", "versus": "grpo-beta-matched", "k": [256, 1024]}]
CONTEXT = [
    {"arm": "grpo", "versus": REFERENCE, "k": [1, 256, 1024]},
    {"arm": "grpo-beta-matched", "versus": "grpo", "k": [1, 256, 1024]},
    {"arm": "sage-branch-active", "versus": "grpo", "k": [1, 256, 1024]},
    {"arm": "sage-branch-exact", "versus": "grpo-kl-in-reward", "k": [1, 256, 1024]},
    {"arm": "grpo-kl-in-reward", "versus": "grpo", "k": [1, 256, 1024]},
]


@dataclasses.dataclass(frozen=True)
class Arm:
    """One way of training: the KL weight, where the KL acts ("loss" or "reward": J's advantage)
    and the branch guide's gamma and tau (None: no guide)."""

    name: str
    beta: float
    way: str = "loss"
    gamma: float | None = None
    tau: float | None = None

    @property
    def algorithm(self) -> str:
        return "grpo" if self.gamma is None else "sage-branch"


def base_options(steps: int | None = None) -> Options:
    """The coverage toy's options (32 prompts, beta 0.05), trained with the sampled way's defaults."""
    opts = coverage_options(Options())
    return opts if steps is None else dataclasses.replace(opts, sampled_steps=steps)


def guide_at_start(toy: Toy, gamma: float, tau: float) -> dict:
    """The branch guide's mean q and share of q > 1 over pi_ref's tokens (each prefix weighted by
    how often pi_ref reaches it)."""
    task, o = toy.task, toy.opts
    q = (1 + gamma * (E.node_entropy(task.ref_logits) - tau).clamp(min=0)).clamp(o.q_min, o.q_max)
    reach = E.visitation(task, toy.ref_seq)
    return {
        "q_mean": float((reach * q).sum() / reach.sum()),
        "frac_q_gt_1": float((reach * (q > 1)).sum() / reach.sum()),
    }


def design(opts: Options) -> dict:
    """The start's entropy quantiles, the active and the paper's guides there, and the arms."""
    toy = Toy(opts)
    quantile = functools.partial(E.entropy_quantile, toy.task, toy.task.ref_logits)
    h_median, h_top = quantile(MEDIAN), quantile(TOP)
    active = {"tau": h_median, "gamma": (opts.q_max - 1.0) / (h_top - h_median)}
    active.update(guide_at_start(toy, **active))
    paper = {**PAPER, **guide_at_start(toy, **PAPER)}
    beta = opts.beta
    arms = [
        Arm("grpo", beta),
        Arm("grpo-beta1.4x", beta * opts.q_max),
        Arm("grpo-beta-matched", beta * active["q_mean"]),
        Arm("grpo-no-kl", 0.0),
        Arm("sage-branch-paper", beta, gamma=PAPER["gamma"], tau=PAPER["tau"]),
        Arm("sage-branch-active", beta, gamma=active["gamma"], tau=active["tau"]),
        Arm("grpo-kl-in-reward", beta, way="reward"),
        Arm("sage-branch-exact", beta, way="reward", gamma=active["gamma"], tau=active["tau"]),
    ]
    return {
        "entropy_quantiles": {str(level): quantile(level) for level in (0.5, 0.8, 0.9)},
        "active_guide": active,
        "paper_guide": paper,
        "arms": [dataclasses.asdict(arm) for arm in arms],
    }


@functools.lru_cache(maxsize=16)
def _toy(opts: Options) -> Toy:
    return Toy(opts)


def run_one(opts: Options, arm: Arm, seed: int) -> dict:
    """One (arm, seed) training run; the exact P(correct) per prompt at its end and averaged over
    the evaluations of its second half, and the guide's activity where it acts."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    arm_opts = opts if arm.gamma is None else dataclasses.replace(opts, gamma=arm.gamma, tau=arm.tau)
    toy = _toy(arm_opts)
    generator = torch.Generator().manual_seed(seed)
    reward = "recomputed" if arm.way == "reward" else ""
    activity = []

    def step(theta):
        activity.append(sampled_step(toy, theta, arm.algorithm, generator, reward, beta=None if reward else arm.beta))

    theta, curve, settled = train(toy, step, toy.start(), toy.ref_seq, sampled=True)
    task, end = toy.task, toy.seq_logp(theta)
    window = max(1, int(len(activity) * WINDOW))
    first, last = np.mean(activity[:window], axis=0), np.mean(activity[-window:], axis=0)
    return {
        "arm": arm.name,
        "seed": seed,
        "p_correct": (end.exp() * task.reward).sum(-1).tolist(),
        "p_correct_second_half": (settled.exp() * task.reward).sum(-1).tolist(),
        "q_mean_first_last": [float(first[0]), float(last[0])],
        "frac_q_gt_1_first_last": [float(first[1]), float(last[1])],
        "tv_to_reference_curve": curve,
        "wall_s": time.perf_counter() - start,
    }


def _run_and_save(opts: Options, arm: Arm, seed: int, path: Path) -> dict:
    record = run_one(opts, arm, seed)
    write_file(path, json.dumps(record) + "\n")
    return record


# ----------------------------------------------------------------------------- numbers


def pass_at_k(p_correct, ks=KS) -> np.ndarray:
    """Exact pass@k [len(ks)] averaged over prompts, from P(correct) per prompt."""
    p = np.clip(np.asarray(p_correct, dtype=np.float64), 0.0, 1.0)
    return np.array([float(np.mean(1.0 - (1.0 - p) ** k)) for k in ks])


def per_seed(result: dict, arm: str, k: int, key: str = "p_correct") -> dict:
    """{seed: exact pass@k (prompt mean)} of an arm (pi_ref: every seed the same)."""
    if arm == REFERENCE:
        value = float(pass_at_k(result["reference_p_correct"], [k])[0])
        return {int(s): value for s in result["seeds"]}
    runs = result["runs"].get(arm, {})
    return {int(seed): float(pass_at_k(run[key], [k])[0]) for seed, run in runs.items()}


def contrast(result: dict, entry: dict, k: int, key: str = "p_correct") -> dict:
    own, other = per_seed(result, entry["arm"], k, key), per_seed(result, entry["versus"], k, key)
    seeds = sorted(set(own) & set(other))
    row = {"arm": entry["arm"], "versus": entry["versus"], "k": k, "seeds": seeds}
    return {**row, **t_test([own[s] - other[s] for s in seeds])} if len(seeds) > 1 else row


def endpoints(result: dict) -> dict:
    """{"primary": rows with p and Holm's p_holm over the primaries, "context": rows with p}."""
    primary = [contrast(result, e, k) for e in PRIMARY for k in e["k"]]
    for row, adjusted in zip(primary, holm([row.get("p") for row in primary])):
        row["p_holm"] = adjusted
    return {"primary": primary, "context": [contrast(result, e, k) for e in CONTEXT for k in e["k"]]}


def arm_table(result: dict, key: str = "p_correct") -> dict:
    """{arm: {"pass_at_k": {k: t_test}, "vs_grpo": {k: t_test}}} over seeds, every k of KS."""
    table = {}
    for arm in [REFERENCE, *result["runs"]]:
        entry = {"pass_at_k": {}, "vs_grpo": {}}
        for k in KS:
            values = per_seed(result, arm, k, key)
            entry["pass_at_k"][str(k)] = t_test(list(values.values())) if len(values) > 1 else {}
            if arm != "grpo":
                entry["vs_grpo"][str(k)] = contrast(result, {"arm": arm, "versus": "grpo"}, k, key)
        table[arm] = entry
    return table


def recompute(path) -> dict:
    """Every interval and p-value of a sampled.json from its stored P(correct): {"endpoints",
    "arms", "arms_second_half"}, as the file stores them (a reader's check)."""
    result = json.loads(Path(path).read_text())
    return recompute_from(result)


# ----------------------------------------------------------------------------- the command


def seeds_of(text: str) -> list:
    """ "5000-5029" or "1,2,3" -> a list of seeds."""
    if "-" in text.strip("-"):
        low, high = (int(part) for part in text.split("-"))
        return list(range(low, high + 1))
    return [int(part) for part in text.split(",") if part.strip()]


def run_study(out: Path, seeds: list, jobs: int, opts: Options, log=print) -> dict:
    """Every (arm, seed) run not already in out/runs, then sampled.json, sampled.md and pass_at_k.png."""
    start = time.perf_counter()
    plan = design(opts)
    arms = [Arm(**entry) for entry in plan["arms"]]
    runs_dir = out / "runs"
    make_dir(runs_dir)
    todo = [(a, s) for s in seeds for a in arms if not (runs_dir / f"{a.name}-s{s}.json").is_file()]
    log(f"toy-sampled: {len(arms)} arms x {len(seeds)} seeds, {len(todo)} runs to do, {jobs} at a time")
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_run_and_save, opts, a, s, runs_dir / f"{a.name}-s{s}.json") for a, s in todo]
        for done, future in enumerate(as_completed(futures), 1):
            record = future.result()
            elapsed = time.perf_counter() - start
            eta = elapsed / done * (len(todo) - done)
            run = f"{record['arm']} s{record['seed']} ({record['wall_s']:.0f}s)"
            log(f"  [{done}/{len(todo)}] {run}, eta {eta / 60:.0f} min")
    toy = _toy(opts)
    result = {
        "command": "python -m sage_train.study.toy.sampled " + " ".join(sys.argv[1:]),
        "options": dataclasses.asdict(opts),
        "design": plan,
        "seeds": seeds,
        "ks": list(KS),
        "reference_p_correct": (toy.ref_seq.exp() * toy.task.reward).sum(-1).tolist(),
        "runs": {a.name: {} for a in arms},
        "wall_time_s": time.perf_counter() - start,
    }
    for a in arms:
        for s in seeds:
            result["runs"][a.name][str(s)] = json.loads((runs_dir / f"{a.name}-s{s}.json").read_text())
    result.update(recompute_from(result))
    write_file(out / "sampled.json", json.dumps(result, indent=1) + "\n")
    write_file(out / "sampled.md", markdown(result) + "\n")
    plot(result, out / "pass_at_k.png")
    log(summary(result))
    return result


def recompute_from(result: dict) -> dict:
    return {
        "endpoints": endpoints(result),
        "arms": arm_table(result),
        "arms_second_half": arm_table(result, "p_correct_second_half"),
    }


def summary(result: dict) -> str:
    lines = ["toy-sampled: primaries (points, paired by seed, 95% t-interval, p, Holm-adjusted p)"]
    for row in result["endpoints"]["primary"]:
        name = f"{row['arm']} - {row['versus']} at pass@{row['k']}"
        lines.append(f"  {name}: {format_points(row, p=True)}, p_holm = {row['p_holm']:.3g}")
    for row in result["endpoints"]["context"]:
        lines.append(f"  (context) {row['arm']} - {row['versus']} at pass@{row['k']}: {format_points(row, p=True)}")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    d, ks = result["design"], ["1", "16", "64", "256", "1024"]
    lines = [
        "# The coverage toy with sampled groups",
        "",
        f"- command: `{result['command']}`; seeds {result['seeds'][0]}..{result['seeds'][-1]} "
        f"({len(result['seeds'])}); wall time {result['wall_time_s'] / 60:.1f} min for this invocation",
        f"- start's token entropy quantiles (pi_ref-visited): {json.dumps(d['entropy_quantiles'])}",
        f"- active guide: {json.dumps(d['active_guide'])}; paper's guide: {json.dumps(d['paper_guide'])}",
        "- arms: "
        + "; ".join(f"`{a['name']}`: {json.dumps({k: v for k, v in a.items() if k != 'name'})}" for a in d["arms"]),
        "",
        "Points of exact pass@k (mean over the 32 prompts), paired by seed; 95% t-interval over seeds.",
        "",
        "## Registered primaries (Holm over these)",
        "",
        "| endpoint | seeds | difference, p | Holm-adjusted p | seeds above / below |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in result["endpoints"]["primary"]:
        per = row.get("per_seed", [])
        name = f"{row['arm']} - {row['versus']} at pass@{row['k']}"
        lines.append(
            f"| {name} | {len(row['seeds'])} | {format_points(row, p=True)} | "
            f"{row['p_holm']:.3g} | {sum(x > 0 for x in per)} / {sum(x < 0 for x in per)} |"
        )
    lines += [
        "",
        "## Read with them (unadjusted p; no claim of their own)",
        "",
        "| contrast | difference, p |",
        "|---|---:|",
    ]
    lines += [
        f"| {r['arm']} - {r['versus']} at pass@{r['k']} | {format_points(r, p=True)} |"
        for r in result["endpoints"]["context"]
    ]
    for key, title in (("arms", "final policy"), ("arms_second_half", "averaged over the second half of training")):
        lines += ["", f"## pass@k (%) and the difference from grpo (points), {title}", ""]
        lines += [
            "| arm | " + " | ".join(f"pass@{k}" for k in ks) + " | " + " | ".join(f"vs grpo @{k}" for k in ks) + " |"
        ]
        lines += ["|---|" + "---:|" * (2 * len(ks))]
        for arm, entry in result[key].items():
            cells = [f"{100 * entry['pass_at_k'][k]['mean']:.1f}" if entry["pass_at_k"][k] else "-" for k in ks]
            cells += [format_points(entry["vs_grpo"][k]) if k in entry["vs_grpo"] else "" for k in ks]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += ["", "## The guide where it acts (mean over seeds, first -> last tenth of the steps)", ""]
    lines += ["| arm | mean q | tokens with q > 1 |", "|---|---:|---:|"]
    for arm, runs in result["runs"].items():
        q = np.mean([r["q_mean_first_last"] for r in runs.values()], axis=0)
        share = np.mean([r["frac_q_gt_1_first_last"] for r in runs.values()], axis=0)
        lines.append(f"| {arm} | {q[0]:.3f} -> {q[1]:.3f} | {100 * share[0]:.0f}% -> {100 * share[1]:.0f}% |")
    return "\n".join(lines + ["", "![pass@k](pass_at_k.png)"])


def plot(result: dict, path: Path) -> None:
    """pass@k minus pi_ref's per arm (mean over seeds, t-band), and the primaries with their intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    reference = pass_at_k(result["reference_p_correct"])
    for i, (arm, entry) in enumerate(result["arms"].items()):
        if arm == REFERENCE:
            continue
        cells = [entry["pass_at_k"][str(k)] for k in KS]
        mean = np.array([c["mean"] for c in cells]) - reference
        low, high = (
            np.array([c["ci_low"] for c in cells]) - reference,
            np.array([c["ci_high"] for c in cells]) - reference,
        )
        left.plot(KS, 100 * mean, marker="o", markersize=3, label=arm, color=f"C{i % 10}")
        left.fill_between(KS, 100 * low, 100 * high, color=f"C{i % 10}", alpha=0.12)
    left.axhline(0.0, color="black", linewidth=0.8)
    left.set(xscale="log", xlabel="k", ylabel="points", title="exact pass@k minus pi_ref's (mean over seeds, 95% CI)")
    left.legend(fontsize=7)
    rows = result["endpoints"]["primary"] + result["endpoints"]["context"]
    labels = [f"{r['arm']} - {r['versus']} @{r['k']}" for r in rows]
    for y, row in enumerate(rows):
        color = "C3" if row in result["endpoints"]["primary"] else "C7"
        right.errorbar(
            100 * row["mean"],
            y,
            xerr=[[100 * (row["mean"] - row["ci_low"])], [100 * (row["ci_high"] - row["mean"])]],
            fmt="o",
            color=color,
            capsize=3,
        )
    right.axvline(0.0, color="black", linewidth=0.8)
    right.set_yticks(range(len(rows)), labels, fontsize=7)
    right.invert_yaxis()
    right.set(xlabel="points (95% CI over seeds)", title="primaries (red) and context (grey)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    save_figure(fig, path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sage_train.study.toy.sampled", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, help="the study directory (resumable)")
    parser.add_argument("--seeds", default="5000-5029", help="'A-B' or a comma list")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each its own process")
    parser.add_argument("--steps", type=int, default=None, help="sampled steps per run (default the toy's 3000)")
    args = parser.parse_args(argv)
    seeds = seeds_of(args.seeds)
    if len(seeds) < 2 or args.jobs < 1 or (args.steps is not None and args.steps < 1):
        print("toy.sampled: --seeds needs at least 2 seeds, --jobs and --steps at least 1")
        return 2
    run_study(Path(args.out), seeds, args.jobs, base_options(args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
