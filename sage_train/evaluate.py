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
    """The engine seed of one generate call, fixed by (seed, the call's first problem, chunk): a
    run draws the same samples as any other run that makes the same calls."""
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
                    problems_per_call: int = 1, samples_per_call: Optional[int] = None,
                    done: Optional[Mapping[tuple[int, str], dict]] = None,
                    on_record: Optional[Callable[[dict, list[str], list[float]], None]] = None,
                    progress=None) -> dict:
    """Sample `n` completions per problem and seed, grade them with `task`, estimate pass@k.
    A sample counts as correct when the task scores it 1.0.

    sampling: temperature, top_p, ... (its `n` and `seed` are set here per call).
    problems_per_call: prompts per generate call. With 1 (the default) a problem's samples
        depend only on (seed, problem), whatever else is evaluated or resumed; more batches
        better (an HF engine with small n) but ties the draw to the batch.
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
    if problems_per_call < 1:
        raise ValueError(f"problems_per_call must be >= 1, got {problems_per_call}")
    chunk = n if samples_per_call is None else samples_per_call
    if chunk < 1:
        raise ValueError(f"samples_per_call must be >= 1, got {samples_per_call}")
    done = done or {}
    records: dict[tuple[int, str], dict] = {}
    for seed in seeds:
        for problem in problems:
            if (seed, problem.id) in done:
                if done[seed, problem.id]["n"] != n:
                    raise ValueError(f"done: the record of {problem.id!r} (seed {seed}) has "
                                     f"n={done[seed, problem.id]['n']}, not n={n}")
                records[seed, problem.id] = done[seed, problem.id]
                if progress is not None:
                    progress.update(n)
        pending = [p for p in problems if (seed, p.id) not in done]
        for first in range(0, len(pending), problems_per_call):
            batch = pending[first:first + problems_per_call]
            texts = sample(engine, [task.prompt(p) for p in batch], sampling, n, chunk, seed, batch[0].id)
            for problem, completions in zip(batch, texts):
                scores = grade(task, completions, problem)
                record = {"problem_id": problem.id, "seed": seed, "n": n,
                          "c": sum(1 for s in scores if s == 1.0)}
                if on_record is not None:
                    on_record(record, completions, scores)
                records[seed, problem.id] = record
                if progress is not None:
                    progress.update(n)
    ordered = [records[seed, p.id] for seed in seeds for p in problems]
    counts = {s: [(r["n"], r["c"]) for r in ordered if r["seed"] == s] for s in seeds}
    resumed = sum(1 for key in records if key in done)
    return {"problems": ordered, "pass_at_k": summarize(counts, ks),
            "generated": len(records) - resumed, "resumed": resumed}


def sample(engine: RolloutEngine, prompts: list[str], sampling: SamplingParams, n: int, chunk: int,
           seed: int, first_id: str) -> list[list[str]]:
    """`n` completion texts per prompt, drawn in calls of `chunk` samples per prompt."""
    texts: list[list[str]] = [[] for _ in prompts]
    for index, start in enumerate(range(0, n, chunk)):
        params = dataclasses.replace(sampling, n=min(chunk, n - start),
                                     seed=sample_seed(seed, first_id, index))
        for mine, completions in zip(texts, engine.generate(prompts, params)):
            mine += [c.text for c in completions]
    return texts


# ----------------------------------------------------------------------------- the CLI: models, tasks, files

RECORDS_FILE = "records.jsonl"
COMPLETIONS_FILE = "completions.jsonl"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model to evaluate: its label (plots, tables, records), HF directory, and run config."""

    label: str
    path: str
    run_config: Optional[dict]


def resolve_models(paths: Sequence[str]) -> list[ModelSpec]:
    """Run directories (`config.yaml` + `final/`) load `<run>/final`; anything else is an HF
    directory or hub name. Labels are the run or directory names, full paths if those clash."""
    resolved = []
    for given in paths:
        path = Path(given)
        if (path / "config.yaml").is_file() and (path / "final").is_dir():
            import yaml

            config = yaml.safe_load((path / "config.yaml").read_text()) or {}
            resolved.append((path.resolve().name, str(path / "final"), config))
        elif (path / "config.yaml").is_file() and not (path / "config.json").is_file():
            raise ValueError(f"--model {given!r} is a run directory without a final model "
                             f"({path / 'final'}); did the run finish?")
        elif path.exists() and not path.is_dir():
            raise ValueError(f"--model {given!r}: expected a run directory, an HF model directory "
                             "or a hub name")
        else:
            name = path.resolve().name if path.is_dir() else given
            if name == "final" and path.is_dir():  # runs/<name>/final: call it by the run's name
                name = path.resolve().parent.name
            resolved.append((name, given, None))
    labels = [label for label, _, _ in resolved]
    if len(set(labels)) < len(labels):
        resolved = [(path, path, config) for _, path, config in resolved]
    if len({label for label, _, _ in resolved}) < len(resolved):
        raise ValueError(f"--model given twice: {list(paths)}")
    return [ModelSpec(*entry) for entry in resolved]


def build_engine(kind: str, model_path: str, device: str) -> RolloutEngine:
    """A rollout engine sampling from the model at `model_path`: "hf" loads it with transformers
    on `device`; "vllm" hands the path to a vLLM engine that owns the GPU (no sleep mode: there is
    no training to share memory with)."""
    from .rollout import make_engine

    if kind == "hf":
        from .model import load_pretrained

        model, tokenizer = load_pretrained(model_path)
        model.to(device).eval()
        return make_engine("hf", model, tokenizer, device=device)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return make_engine(kind, model_path, tokenizer, enable_sleep_mode=False, gpu_memory_utilization=0.85)


def read_records(out: Path) -> dict[tuple[str, str, int, str], dict]:
    """Finished problems of an earlier run in `out`, keyed by (model, task, seed, problem id).

    A kill can leave the last line half written: it is dropped (that problem is redone) and
    cut from the file so that new records start on a fresh line."""
    path = out / RECORDS_FILE
    if not path.is_file():
        return {}
    records, good_bytes = {}, 0
    with open(path, "rb") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number} is not a JSON record; remove the file to start afresh")
        if not line.endswith(b"\n"):
            break
        records[(record["model"], record["task"], record["seed"], record["problem_id"])] = record
        good_bytes += len(line)
    if good_bytes < path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return records


def check_sampling(out: Path, sampling: dict) -> None:
    """Refuse to resume into `out` with different sampling settings; record them on first use."""
    path = out / "sampling.json"
    if path.is_file():
        previous = json.loads(path.read_text())
        changed = {k: (previous.get(k), sampling[k]) for k in sampling if previous.get(k) != sampling[k]}
        if changed:
            details = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in changed.items())
            raise ValueError(f"--out {out} holds samples drawn with other settings ({details}); "
                             "use another --out or the same settings")
    else:
        path.write_text(json.dumps(sampling, indent=1) + "\n")


def parse_ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sage-eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True,
                   help="a run directory (loads <run>/final), an HF model directory or a hub name; "
                        "repeatable")
    p.add_argument("--tasks", default="",
                   help="comma-separated task names (math500, aime24, aime25, amc23, minerva, a .jsonl path, "
                        "arithmetic, countdown, knights); default: the first run directory's task")
    p.add_argument("--task-options", default="{}",
                   help='JSON options per task, e.g. \'{"arithmetic": {"digits": 3}}\' '
                        "(default: a run directory's task_options for its task)")
    p.add_argument("--n", type=int, default=16, help="samples per problem and seed")
    p.add_argument("--k", default="", help="comma-separated ks (default: 1, 2, 4, ... up to n)")
    p.add_argument("--seeds", default="0", help="comma-separated sampling seeds")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first LIMIT problems of each task")
    p.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    p.add_argument("--device", default=None, help="hf engine device (default: cuda if available, else cpu)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: a run directory's eval_max_new_tokens or max_new_tokens, else 1024")
    p.add_argument("--stop", action="append", default=None, help="a stop string; repeatable")
    p.add_argument("--problems-per-call", type=int, default=1,
                   help="prompts per generate call (more is faster with the hf engine and small n; "
                        "1 makes each problem's samples independent of the others)")
    p.add_argument("--samples-per-call", type=int, default=None,
                   help="split each problem's n samples into generate calls of this many")
    p.add_argument("--save-completions", action="store_true",
                   help=f"also write every completion and its score to {COMPLETIONS_FILE}")
    p.add_argument("--out", default=None, help="output directory (default: <first run dir>/eval, else eval)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def resolve_tasks(args, models: Sequence[ModelSpec]) -> list[tuple[str, dict]]:
    """(name, options) of each task: --tasks, or else the first run directory's task."""
    try:
        options = json.loads(args.task_options)
    except json.JSONDecodeError as e:
        raise ValueError(f"--task-options is not valid JSON ({e}): {args.task_options!r}") from None
    if not isinstance(options, dict):
        raise ValueError(f"--task-options must be a JSON object keyed by task name, "
                         f"got {args.task_options!r}")
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if len(set(names)) < len(names):
        raise ValueError(f"--tasks names a task twice: {args.tasks!r}")
    run_config = next((m.run_config for m in models if m.run_config is not None), None)
    if not names:
        if run_config is None:
            raise ValueError("--tasks is required unless a --model is a run directory (its task is used)")
        names = [run_config.get("eval_task") or run_config["task"]]
    if run_config is not None:
        for name in names:
            if name == run_config.get("task") and name not in options:
                options[name] = dict(run_config.get("task_options") or {})
    return [(name, options.get(name, {})) for name in names]


class RecordWriter:
    """Appends finished problems to records.jsonl (and completions.jsonl), flushed at once so
    that a killed run loses at most the problem in progress."""

    def __init__(self, out: Path, save_completions: bool):
        self.records = open(out / RECORDS_FILE, "a")
        self.completions = open(out / COMPLETIONS_FILE, "a") if save_completions else None

    def writer_for(self, model: str, task: str) -> Callable[[dict, list[str], list[float]], None]:
        """An `on_record` callback for `evaluate_engine` that tags records with model and task."""
        def write(record: dict, completions: list[str], scores: list[float]) -> None:
            keyed = {"model": model, "task": task} | record
            if self.completions is not None:  # first, so that a record implies its completions
                texts = keyed | {"completions": completions, "scores": scores}
                self.completions.write(json.dumps(texts) + "\n")
                self.completions.flush()
            self.records.write(json.dumps(keyed) + "\n")
            self.records.flush()
        return write

    def close(self) -> None:
        self.records.close()
        if self.completions is not None:
            self.completions.close()


def main(argv=None) -> int:
    """`sage-eval`: evaluate every model on every task; see the module docstring."""
    args = build_parser().parse_args(argv)
    models = resolve_models(args.model)
    run_config = next((m.run_config for m in models if m.run_config is not None), {}) or {}
    max_new_tokens = args.max_new_tokens or run_config.get("eval_max_new_tokens") \
        or run_config.get("max_new_tokens") or 1024
    stop = tuple(args.stop if args.stop is not None else run_config.get("stop") or ())
    powers_of_two = [2 ** i for i in range(args.n.bit_length())] + [args.n]
    ks = check_ks(parse_ints(args.k, "--k") if args.k else powers_of_two, args.n)
    seeds = parse_ints(args.seeds, "--seeds")
    if not seeds:
        raise ValueError("--seeds is empty")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              min_p=args.min_p, max_new_tokens=max_new_tokens, stop=stop)
    out = Path(args.out or (Path(args.model[0]) / "eval" if models[0].run_config is not None else "eval"))
    out.mkdir(parents=True, exist_ok=True)
    check_sampling(out, {"n": args.n, "temperature": args.temperature, "top_p": args.top_p,
                         "top_k": args.top_k, "min_p": args.min_p, "max_new_tokens": max_new_tokens,
                         "stop": list(stop), "engine": args.engine})

    from .tasks import get_task

    tasks = [get_task(name, **options) for name, options in resolve_tasks(args, models)]
    problems = {task.name: list(task.problems("test", args.limit, 0)) for task in tasks}
    config = {"models": {m.label: m.path for m in models}, "tasks": [t.name for t in tasks], "n": args.n,
              "ks": ks, "seeds": seeds, "limit": args.limit, "engine": args.engine,
              "sampling": dataclasses.asdict(sampling) | {"n": args.n, "seed": None},
              "problems_per_call": args.problems_per_call, "samples_per_call": args.samples_per_call}
    results = {"config": config, "models": {}, "generated": 0, "resumed": 0}
    done = read_records(out)
    writer = RecordWriter(out, args.save_completions)
    from tqdm.auto import tqdm

    bar = tqdm(total=len(models) * len(seeds) * args.n * sum(map(len, problems.values())), unit="sample",
               desc="sage-eval", disable=args.no_progress, dynamic_ncols=True)
    try:
        for model in models:
            engine = None  # loaded only if some problem of this model is not done yet
            results["models"][model.label] = {"path": model.path, "tasks": {}}
            for task in tasks:
                mine = {(seed, pid): record for (label, name, seed, pid), record in done.items()
                        if label == model.label and name == task.name}
                if engine is None and any((s, p.id) not in mine for s in seeds for p in problems[task.name]):
                    engine = build_engine(args.engine, model.path, _device(args.device))
                bar.set_postfix_str(f"{model.label} / {task.name}")
                result = evaluate_engine(
                    engine, task, problems[task.name], n=args.n, ks=ks, sampling=sampling, seeds=seeds,
                    problems_per_call=args.problems_per_call, samples_per_call=args.samples_per_call,
                    done=mine,
                    on_record=writer.writer_for(model.label, task.name), progress=bar)
                results["generated"] += result.pop("generated")
                results["resumed"] += result.pop("resumed")
                results["models"][model.label]["tasks"][task.name] = result
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished problems are kept in {out / RECORDS_FILE}; "
              "rerun the same command to resume", file=sys.stderr)
        return 130
    finally:
        bar.close()
        writer.close()
    from .rewards import grading_stats

    results["grading"] = grading_stats()  # math-verify timeouts (graded 0) are counted here
    write_outputs(out, results)
    print(markdown_table(results))
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'pass_at_k.png'}")
    return 0


def _device(requested: Optional[str]) -> str:
    if requested:
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- outputs

def write_outputs(out: Path, results: dict) -> None:
    """results.json, results.md and pass_at_k.png in `out`."""
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown_table(results) + "\n")
    plot_curves(results, out / "pass_at_k.png")


def markdown_table(results: dict) -> str:
    """One table per task: a row per model, a column per k, cells "mean ± std" in percent."""
    ks = results["config"]["ks"]
    seeds = len(results["config"]["seeds"])
    lines = [f"pass@k (%), n = {results['config']['n']}, mean ± std over {seeds} seed(s)"]
    for task in results["config"]["tasks"]:
        lines += ["", f"### {task}", "",
                  "| model | problems | " + " | ".join(f"pass@{k}" for k in ks) + " |",
                  "|---|---:|" + "---:|" * len(ks)]
        for label, model in results["models"].items():
            result = model["tasks"][task]
            cells = [f"{100 * result['pass_at_k'][k]['mean']:.1f} ± {100 * result['pass_at_k'][k]['std']:.1f}"
                     for k in ks]
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
    for ax in axes.flat[len(tasks):]:
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
    fig.savefig(path, dpi=120)
    plt.close(fig)
