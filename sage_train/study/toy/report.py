"""The enumerable toys' summaries and figures (docs/results/toy.md): the sampled ways over seeds,
sage-branch against grpo per way, TV along training and exact pass@k."""

from __future__ import annotations

from pathlib import Path

from ...safe_files import save_figure
from . import enumerable as E

COLOURS = {"grpo": "tab:blue", "sage-branch": "tab:red", "sage-token": "tab:green"}
TITLES = {
    "exact": "(a) exact gradient of J",
    "expected": "(b) the loss in expectation",
    "kl_only": "(b) zero advantages, to q pi_ref / Z_t",
    "sampled": "(c) sampled, G per prompt",
    "reward_expected": "(d) kl_in_reward in expectation",
    "reward_sampled": "(e) kl_in_reward sampled",
}


def mean(values):
    """Mean over seeds of numbers, or elementwise of equal-length lists."""
    return [sum(c) / len(c) for c in zip(*values)] if isinstance(values[0], list) else sum(values) / len(values)


def sampled_report(toy, algorithm: str, ends: list, expected_end) -> dict:
    """(c) or (e) per seed and averaged over seeds: the final table and the second-half average
    (`settled`), against pi* and `expected_end` ((b)'s end, or the self-consistent optimum).
    `toy` is the `tabular.Toy`; `ends` [(final, settled)] sequence log-probs per seed."""
    optimum, runs = toy.optimum[algorithm], []
    for seq, settled in ends:
        runs.append(toy.report(seq, algorithm))
        runs[-1]["tv_to_expected"] = float(E.tv(seq, expected_end).mean())
        runs[-1]["settled_tv_to_optimum"] = float(E.tv(settled, optimum).mean())
        runs[-1]["settled_tv_to_expected"] = float(E.tv(settled, expected_end).mean())
        runs[-1]["settled_pass_at_k"] = toy.report(settled, algorithm)["pass_at_k"]
    return {"per_seed": runs, **{key: mean([r[key] for r in runs]) for key in runs[0]}}


def compare(result: dict, expected_end: dict, sampled_end: dict) -> dict:
    """How far sage-branch ends from grpo, per way: pass@k differences; for (b) the TV between the two
    ends; for (c) the TV between a branch seed and a grpo seed against that between two grpo seeds
    (the noise floor), for the final tables and the second-half averages, and the paired pass@1 gaps."""
    out = {}
    for way in ("optimum", "self_consistent", "exact", "reward_expected", "expected", "sampled", "reward_sampled"):
        diff = [b - g for b, g in zip(result[way]["sage-branch"]["pass_at_k"], result[way]["grpo"]["pass_at_k"])]
        out[way] = {"pass_at_k_difference": diff, "max_abs_pass_at_k_difference": max(abs(d) for d in diff)}
    out["expected"]["tv_between"] = float(E.tv(expected_end["sage-branch"], expected_end["grpo"]).mean())
    seeds = range(len(sampled_end["sampled", "grpo"]))
    pairs = [(j, k) for j in seeds for k in seeds if j != k]
    for i, name in enumerate(("final", "settled")):
        for a, label in (("sage-branch", "branch"), ("grpo", "grpo")):
            ours, theirs = sampled_end["sampled", a], sampled_end["sampled", "grpo"]
            tvs = [float(E.tv(ours[j][i], theirs[k][i]).mean()) for j, k in pairs]
            out["sampled"][f"tv_{name}_{label}_to_grpo_seeds"] = mean(tvs) if tvs else None
    per_seed = [result["sampled"][a]["per_seed"] for a in ("sage-branch", "grpo")]
    out["sampled"]["pass_at_1_paired_gaps"] = [b["pass_at_k"][0] - g["pass_at_k"][0] for b, g in zip(*per_seed)]
    return out


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(result: dict, out: Path) -> list[str]:
    """tv_curves.png (TV to each way's target along training) and pass_at_k.png (exact curves)."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(14, 7), sharey=True)
    for ax, way in zip(axes.flat, TITLES):
        for key, curve in result["curves"].items():
            parts = key.split(" ")
            label = parts[1] if len(parts) == 2 or parts[2] == "0" else None
            if parts[0] == way:
                alpha = 0.5 if len(parts) == 3 else 1.0  # one line per seed
                ax.plot(*zip(*curve), color=COLOURS[parts[1]], alpha=alpha, label=label)
        ax.set_yscale("symlog", linthresh=1e-3)  # TV spans 1 down to the 1e-6 of a converged way
        ax.set(title=TITLES[way], xlabel="step")
    for ax in axes[:, 0]:
        ax.set_ylabel("TV to target (mean over prompts)")
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out / "tv_curves.png", dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.6))
    ax.plot(result["ks"], result["reference"]["pass_at_k"], color="black", marker=".", label="pi_ref")
    ways = (("optimum", "-"), ("self_consistent", "-."), ("expected", "--"), ("sampled", ":"))
    for way, style in ways:
        for a, report in result[way].items():
            if way != "self_consistent" or a != "grpo":  # grpo's is its optimum
                label = f"{way} {a}"
                ax.plot(result["ks"], report["pass_at_k"], color=COLOURS[a], linestyle=style, marker=".", label=label)
    ax.set(xscale="log", xlabel="k", ylabel="exact pass@k (mean over prompts)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out / "pass_at_k.png", dpi=80)
    plt.close(fig)
    return ["tv_curves.png", "pass_at_k.png"]


def plot_coverage(result: dict, out: Path) -> list[str]:
    """coverage_pass_at_k.png: every arm's exact pass@k, and its difference from pi_ref's."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    ks, reference = result["ks"], result["reference"]["pass_at_k"]
    left.plot(ks, reference, color="black", marker=".", label="start (pi_ref)")
    right.axhline(0.0, color="black", linewidth=0.8)
    for i, (name, arm) in enumerate(result["arms"].items()):
        # arms that end in the same place overlap: each later one thinner and dashed, so both show
        style = {"color": plt.cm.tab10(i % 10), "linewidth": 3.2 - 0.3 * i, "linestyle": ("-", "--", ":")[i % 3]}
        left.plot(ks, arm["pass_at_k"], label=name, **style)
        right.plot(ks, [a - r for a, r in zip(arm["pass_at_k"], reference)], label=name, **style)
    left.set(xscale="log", xlabel="k", ylabel="exact pass@k (mean over prompts)", title="pass@k")
    right.set(xscale="log", xlabel="k", ylabel="pass@k - pi_ref's", title="against the start")
    right.set_yscale("symlog", linthresh=1e-2)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out / "coverage_pass_at_k.png", dpi=80)
    plt.close(fig)
    return ["coverage_pass_at_k.png"]
