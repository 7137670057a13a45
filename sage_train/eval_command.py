"""`sage-eval`: the command around `sage_train.evaluate` (models, tasks, resumable records, outputs).

See `sage_train.evaluate` for the estimator and the files written; `sage_train.cli.eval_main`
is the console entry point (bad arguments exit 2 with one line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from . import evaluate
from .evaluate import check_ks, evaluate_engine, markdown_table, write_outputs
from .rollout.base import RolloutEngine, SamplingParams

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
    p = argparse.ArgumentParser(prog="sage-eval", description=evaluate.__doc__.split("\n\n")[0],
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
