"""Unbiased pass@k of models on verifiable tasks, over seeds, with resumable runs and curves.

The estimator (Chen et al., 2021, "Evaluating Large Language Models Trained on Code"): with
`n` samples of which `c` are correct, pass@k = 1 - C(n-c, k) / C(n, k), the probability that a
random k-subset of the samples holds a correct one, computed in the stable product form
1 - prod_{i=n-c+1..n} (1 - k/i). It is computed per problem, then averaged over problems;
pass@1 is therefore the mean of c/n. Each seed samples all n completions afresh; the mean and
the sample standard deviation (ddof 1; 0 for one seed) are over seeds.

`evaluate_engine` is the library entry (the trainer's before/after evaluation calls it);
`sage-eval` (`sage_train.eval.command`) is the command around it:

    sage-eval --model runs/tiny --model runs/base/final --tasks math500,aime24,arithmetic \\
              --n 256 --k 1,2,4,8,16,32,64,128,256 --seeds 0,1,2 --out eval/

It writes to --out: `records.jsonl` (one line per finished (model, task, seed, problem): the
run resumes from it when restarted with the same --out), `results.json` (per-problem n and c,
per-benchmark pass@k, the config), `results.md` (a table) and `pass_at_k.png` (the curves,
log-scale k, one line per model, one panel per task).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..rollout.base import RolloutEngine, SamplingParams, derive_seed
from ..safe_files import save_figure, write_atomically, write_file
from ..tasks import grade
from ..tasks.base import Problem, Task

#: ``eval_splits``' values: "train" the RL prompts, "test" held-out problems
EVAL_SPLITS = ("train", "test")


@dataclass(frozen=True)
class EvalSettings:
    """A training run's own evaluation before and after RL (`run.evaluate_once`): the splits of
    `EVAL_SPLITS` it evaluates, ``eval_problems`` problems each (held out of ``eval_task`` when set,
    drawn with ``held_out_seed``), ``eval_samples`` samples per problem."""

    eval_splits: list
    eval_problems: int
    eval_samples: int
    held_out_seed: int | None
    eval_task: str


# ----------------------------------------------------------------------------- the estimator


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct among `n` samples (requires k <= n)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}] (pass@k needs at least k samples), got {k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def pass_at_k_table(n: int, ks: Sequence[int]):
    """A numpy array [len(ks), n + 1]: row i, column c is `pass_at_k(n, c, ks[i])`, the same
    products in the same order (so the same bits), for looking up a whole matrix of counts at once."""
    import numpy as np

    if not ks or not all(1 <= k <= n for k in ks):
        raise ValueError(f"every k must be in [1, n={n}] (pass@k needs at least k samples per problem); got {ks}")
    ks = np.asarray(ks, dtype=np.float64)
    table = np.ones((ks.size, n + 1))
    for c in range(n + 1):
        prob_all_wrong = np.ones(ks.size)
        for i in range(n - c + 1, n + 1):
            prob_all_wrong *= 1.0 - ks / i
        table[:, c] = np.where(n - c < ks, 1.0, 1.0 - prob_all_wrong)
    return table


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """pass@k averaged over problems given as (n, c) pairs."""
    if not counts:
        raise ValueError("counts is empty: no problem to average over")
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


def summarize(counts_by_seed: Mapping[int, Sequence[tuple[int, int]]], ks: Sequence[int]) -> dict:
    """{k: {"mean", "std", "per_seed"}}: pass@k per seed, then mean and std over seeds."""
    summary = {}
    for k in ks:
        per_seed = [mean_pass_at_k(counts_by_seed[s], k) for s in sorted(counts_by_seed)]
        summary[k] = {
            "mean": statistics.fmean(per_seed),
            "std": statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0,
            "per_seed": per_seed,
        }
    return summary


def check_ks(ks: Sequence[int], n: int) -> list[int]:
    """Sorted distinct ks, each in [1, n]."""
    if not ks:
        raise ValueError("ks is empty")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"every k must be in [1, n={n}] (pass@k needs at least k samples per problem); got {bad}")
    return sorted(set(ks))


# ----------------------------------------------------------------------------- sampling + grading


def sample_seed(seed: int, problem_id: str, chunk: int) -> int:
    """The engine seed of one problem's samples in one generate call, fixed by (seed, problem,
    chunk): a problem draws the same samples whatever else is evaluated, batched or resumed."""
    return derive_seed(seed, problem_id, chunk)


def evaluate_engine(
    engine: RolloutEngine | None,
    task: Task,
    problems: Sequence[Problem],
    *,
    n: int,
    ks: Sequence[int],
    sampling: SamplingParams,
    seeds: Sequence[int],
    problems_per_call: int | None = None,
    samples_per_call: int | None = None,
    done: Mapping[tuple[int, str], dict] | None = None,
    on_record: Callable[[dict, list[str], list[float]], None] | None = None,
    progress=None,
) -> dict:
    """Sample `n` completions per problem and seed, grade them with `task`, estimate pass@k.
    A sample counts as correct when the task scores it 1.0.

    The engine is kept awake (`RolloutEngine.awake`) for the whole evaluation: an engine that
    holds its own weights loads them at most once, not once per call. When `done` holds every
    problem, the engine is not touched and may be None.

    sampling: temperature, top_p, ... (its `n` and seeds are set here per call).
    problems_per_call: prompts per generate call (default: all of a seed's problems in one
        call). Each problem is drawn with its own seed (`sample_seed`), so a problem's samples
        depend only on (seed, problem), however the problems are batched, evaluated or resumed.
    samples_per_call: split the n samples of a problem into generate calls of this many
        (default: all n in one call).
    done: records of an earlier, interrupted run keyed by (seed, problem id); those problems
        are not sampled again.
    on_record(record, completions, scores): called when a problem is finished (the CLI
        persists it).
    progress: a tqdm-like bar, advanced by the number of samples (skipped ones included).

    Returns {"problems": [{"problem_id", "seed", "n", "c"}...], "pass_at_k": {k: {"mean",
    "std", "per_seed"}}, "generated": problems sampled now, "resumed": problems taken from done}.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ks = check_ks(ks, n)
    if not seeds:
        raise ValueError("seeds is empty")
    if not problems:
        raise ValueError(f"task {task.name!r} gave no problems to evaluate")
    if problems_per_call is not None and problems_per_call < 1:
        raise ValueError(f"problems_per_call must be >= 1, got {problems_per_call}")
    chunk = n if samples_per_call is None else samples_per_call
    if chunk < 1:
        raise ValueError(f"samples_per_call must be >= 1, got {samples_per_call}")
    done = done or {}
    records: dict[tuple[int, str], dict] = {}
    left = any((seed, p.id) not in done for seed in seeds for p in problems)
    with engine.awake() if left else contextlib.nullcontext():  # all done: no engine needed (None)
        for seed in seeds:
            for problem in problems:
                if (seed, problem.id) in done:
                    if done[seed, problem.id]["n"] != n:
                        raise ValueError(
                            f"done: the record of {problem.id!r} (seed {seed}) has "
                            f"n={done[seed, problem.id]['n']}, not n={n}"
                        )
                    records[seed, problem.id] = done[seed, problem.id]
                    if progress is not None:
                        progress.update(n)
            pending = [p for p in problems if (seed, p.id) not in done]
            per_call = problems_per_call or max(1, len(pending))
            for first in range(0, len(pending), per_call):
                batch = pending[first : first + per_call]
                texts = sample(engine, [task.prompt(p) for p in batch], sampling, n, chunk, seed, [p.id for p in batch])
                for problem, completions in zip(batch, texts):
                    scores = grade(task, completions, problem)
                    record = {"problem_id": problem.id, "seed": seed, "n": n, "c": sum(1 for s in scores if s == 1.0)}
                    if on_record is not None:
                        on_record(record, completions, scores)
                    records[seed, problem.id] = record
                    if progress is not None:
                        progress.update(n)
    ordered = [records[seed, p.id] for seed in seeds for p in problems]
    counts = {s: [(r["n"], r["c"]) for r in ordered if r["seed"] == s] for s in seeds}
    resumed = sum(1 for key in records if key in done)
    return {
        "problems": ordered,
        "pass_at_k": summarize(counts, ks),
        "generated": len(records) - resumed,
        "resumed": resumed,
    }


def sample(
    engine: RolloutEngine,
    prompts: list[str],
    sampling: SamplingParams,
    n: int,
    chunk: int,
    seed: int,
    problem_ids: Sequence[str],
) -> list[list[str]]:
    """`n` completion texts per prompt, drawn in calls of `chunk` samples per prompt, each
    prompt with its own seed (`sample_seed`)."""
    texts: list[list[str]] = [[] for _ in prompts]
    for index, start in enumerate(range(0, n, chunk)):
        params = dataclasses.replace(
            sampling,
            n=min(chunk, n - start),
            seed=None,
            logprobs=False,
            prompt_seeds=tuple(sample_seed(seed, pid, index) for pid in problem_ids),
        )
        for mine, completions in zip(texts, engine.generate(prompts, params)):
            mine += [c.text for c in completions]
    return texts


# ----------------------------------------------------------------------------- outputs


def write_outputs(out: Path, results: dict, table: str) -> None:
    """results.md (`table`), pass_at_k.png, then results.json in `out`: written last and whole, it is
    what a resumed study or evaluation reads to know this one is done."""
    write_file(out / "results.md", table + "\n")
    plot_curves(results, out / "pass_at_k.png")
    write_atomically(out / "results.json", json.dumps(results, indent=1) + "\n")


def markdown_table(results: dict) -> str:
    """One table per task: a row per model, a column per k, cells "mean ± std" in percent."""
    ks = results["config"]["ks"]
    seeds = len(results["config"]["seeds"])
    lines = [f"pass@k (%), n = {results['config']['n']}, mean ± std over {seeds} seed(s)"]
    for task in results["config"]["tasks"]:
        lines += [
            "",
            f"### {task}",
            "",
            "| model | problems | " + " | ".join(f"pass@{k}" for k in ks) + " |",
            "|---|---:|" + "---:|" * len(ks),
        ]
        for label, model in results["models"].items():
            result = model["tasks"][task]
            cells = [
                f"{100 * result['pass_at_k'][k]['mean']:.1f} ± {100 * result['pass_at_k'][k]['std']:.1f}" for k in ks
            ]
            problems = len(result["problems"]) // seeds
            lines.append(f"| {label} | {problems} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(results: dict, path: Path) -> None:
    """pass@k against k (log2 axis), one panel per task, one line per model, ±std bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = results["config"]["ks"]
    tasks = results["config"]["tasks"]
    seeds = len(results["config"]["seeds"])
    cols = min(3, len(tasks))
    rows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(tasks) :]:
        ax.set_visible(False)
    for ax, task in zip(axes.flat, tasks):
        for label, model in results["models"].items():
            curve = model["tasks"][task]["pass_at_k"]
            mean = [curve[k]["mean"] for k in ks]
            std = [curve[k]["std"] for k in ks]
            ax.plot(ks, mean, marker="o", markersize=3, label=label)
            low, high = [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)]
            ax.fill_between(ks, low, high, alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k")
        ax.set_title(f"{task} (n = {results['config']['n']}, {seeds} seed{'s' if seeds > 1 else ''})")
        ax.set_ylim(-0.02, 1.02)  # a curve at 0 stays visible
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
