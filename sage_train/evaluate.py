"""Unbiased pass@k of models on verifiable tasks, over seeds, with resumable runs and curves.

The estimator (Chen et al., 2021, "Evaluating Large Language Models Trained on Code"): with
`n` samples of which `c` are correct, pass@k = 1 - C(n-c, k) / C(n, k), the probability that a
random k-subset of the samples holds a correct one, computed in the stable product form
1 - prod_{i=n-c+1..n} (1 - k/i). It is computed per problem, then averaged over problems;
pass@1 is therefore the mean of c/n. Each seed samples all n completions afresh; the mean and
the sample standard deviation (ddof 1; 0 for one seed) are over seeds.

`evaluate_engine` is the library entry (the trainer's before/after evaluation calls it);
`main` is `sage-eval`:

    sage-eval --model runs/tiny --model runs/base/final --tasks math500,aime24,arithmetic \\
              --n 256 --k 1,2,4,8,16,32,64,128,256 --seeds 0,1,2 --out eval/

It writes to --out: `records.jsonl` (one line per finished (model, task, seed, problem): the
run resumes from it when restarted with the same --out), `results.json` (per-problem n and c,
per-benchmark pass@k, the config), `results.md` (a table) and `pass_at_k.png` (the curves,
log-scale k, one line per model, one panel per task).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import sys
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from .rollout.base import RolloutEngine, SamplingParams
from .tasks.base import Problem, Task


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
        summary[k] = {"mean": statistics.fmean(per_seed),
                      "std": statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0,
                      "per_seed": per_seed}
    return summary


def check_ks(ks: Sequence[int], n: int) -> list[int]:
    """Sorted distinct ks, each in [1, n]."""
    if not ks:
        raise ValueError("ks is empty")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"every k must be in [1, n={n}] (pass@k needs at least k samples per problem); "
                         f"got {bad}")
    return sorted(set(ks))


# ----------------------------------------------------------------------------- sampling + grading

def sample_seed(seed: int, problem_id: str, chunk: int) -> int:
    """The engine seed of one generate call: fixed by (seed, problem, chunk), so a resumed or
    subset run draws the same samples for a problem as a full one."""
    digest = hashlib.blake2b(f"{seed}:{problem_id}:{chunk}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def grade(task: Task, completions: Sequence[str], problem: Problem) -> list[float]:
    """The task's own scores of the completions of one problem (batched when the task can)."""
    score_batch = getattr(task, "score_batch", None)
    if score_batch is not None:
        return list(score_batch(list(completions), [problem] * len(completions)))
    return [task.score(text, problem) for text in completions]


def evaluate_engine(engine: RolloutEngine, task: Task, problems: Sequence[Problem], *, n: int,
                    ks: Sequence[int], sampling: SamplingParams, seeds: Sequence[int],
                    samples_per_call: Optional[int] = None,
                    done: Optional[Mapping[tuple[int, str], dict]] = None,
                    on_record: Optional[Callable[[dict, list[str]], None]] = None,
                    progress=None) -> dict:
    """Sample `n` completions per problem and seed, grade them with `task`, estimate pass@k.

    sampling: temperature, top_p, ... (its `n` and `seed` are set here per call).
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
    chunk = n if samples_per_call is None else samples_per_call
    if chunk < 1:
        raise ValueError(f"samples_per_call must be >= 1, got {samples_per_call}")
    done = done or {}
    records, generated, resumed = [], 0, 0
    for seed in seeds:
        for problem in problems:
            previous = done.get((seed, problem.id))
            if previous is not None and previous["n"] == n:
                records.append(previous)
                resumed += 1
            else:
                prompt = task.prompt(problem)
                texts: list[str] = []
                for index, start in enumerate(range(0, n, chunk)):
                    params = dataclasses.replace(sampling, n=min(chunk, n - start),
                                                 seed=sample_seed(seed, problem.id, index))
                    texts += [c.text for c in engine.generate([prompt], params)[0]]
                scores = grade(task, texts, problem)
                record = {"problem_id": problem.id, "seed": seed, "n": n,
                          "c": sum(1 for s in scores if s >= 1.0)}
                if on_record is not None:
                    on_record(record, texts, scores)
                records.append(record)
                generated += 1
            if progress is not None:
                progress.update(n)
    counts = {s: [(r["n"], r["c"]) for r in records if r["seed"] == s] for s in seeds}
    return {"problems": records, "pass_at_k": summarize(counts, ks),
            "generated": generated, "resumed": resumed}
