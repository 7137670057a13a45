"""`sage-eval`: the command around `sage_train.eval.evaluate` (models, tasks, resumable records, outputs).

See `sage_train.eval.evaluate` for the estimator and the files written, and `sage_train.eval.settings`
for the options, the prompt format and ``--protocol official``; `sage_train.cli.eval_main` is the
console entry point (bad arguments exit 2 with one line).
"""

from __future__ import annotations

import dataclasses
import sys

from ..safe_files import make_dir, refuse_links
from .evaluate import evaluate_engine, markdown_table, write_outputs
from .models import build_engine, fingerprints
from .records import RECORDS_FILE, RecordWriter, check_fingerprints, check_sampling, read_records
from .settings import AVERAGED, EvalSettings, build_parser, resolve_settings


def main(argv=None) -> int:
    """`sage-eval`: evaluate every model on every task; see the module docstring."""
    return run_eval(resolve_settings(build_parser().parse_args(argv)))


def run_eval(settings: EvalSettings) -> int:
    """Evaluate every model on every task into ``settings.out`` (resuming from its records); returns
    the exit status (130: interrupted, what finished is kept)."""
    st, out = settings, settings.out
    refuse_links(out.parent, [out.name], "sage-eval --out in")  # e.g. a received run's <run>/eval
    weights = fingerprints(st.models, out)
    done = read_records(out)  # nothing is written to `out` before every check has passed
    check_fingerprints(out, done, weights)
    make_dir(out)
    sampling = st.sampling
    check_sampling(
        out,
        {
            "n": st.n,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "min_p": sampling.min_p,
            "max_new_tokens": sampling.max_new_tokens,
            "stop": list(sampling.stop),
            "engine": st.engine,
            "prompt_format": {label: list(f) for label, f in st.formats.items()},
        },
    )

    config = {
        "models": {m.label: m.path for m in st.models},
        "tasks": [t.name for t in st.tasks],
        "n": st.n,
        "ks": st.ks,
        "seeds": st.seeds,
        "limit": st.limit,
        "engine": st.engine,
        "protocol": st.protocol,
        "prompt_format": {label: {"chat_template": t, "system_prompt": s} for label, (t, s) in st.formats.items()},
        "sampling": dataclasses.asdict(sampling) | {"n": st.n, "seed": None},
        "problems_per_call": st.problems_per_call,
        "samples_per_call": st.samples_per_call,
    }
    results = {"config": config, "models": {}, "generated": 0, "resumed": 0}
    writer = RecordWriter(out, st.save_completions, weights)
    from tqdm.auto import tqdm

    bar = tqdm(
        total=len(st.models) * len(st.seeds) * st.n * sum(map(len, st.problems.values())),
        unit="sample",
        desc="sage-eval",
        disable=not st.progress,
        dynamic_ncols=True,
    )
    try:
        for model in st.models:
            engine = None  # loaded only if some problem of this model is not done yet
            results["models"][model.label] = {"path": model.path, "fingerprint": weights[model.label], "tasks": {}}
            for plain_task in st.tasks:
                task = st.prompted[model.label, plain_task.name]
                mine = {
                    (seed, pid): record
                    for (label, name, seed, pid), record in done.items()
                    if label == model.label and name == task.name
                }
                if engine is None and any((s, p.id) not in mine for s in st.seeds for p in st.problems[task.name]):
                    engine = build_engine(st.engine, model.path, _device(st.device))
                bar.set_postfix_str(f"{model.label} / {task.name}")
                result = evaluate_engine(
                    engine,
                    task,
                    st.problems[task.name],
                    n=st.n,
                    ks=st.ks,
                    sampling=sampling,
                    seeds=st.seeds,
                    problems_per_call=st.problems_per_call,
                    samples_per_call=st.samples_per_call,
                    done=mine,
                    on_record=writer.writer_for(model.label, task.name),
                    progress=bar,
                )
                results["generated"] += result.pop("generated")
                results["resumed"] += result.pop("resumed")
                results["models"][model.label]["tasks"][task.name] = result
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: finished problems are kept in {out / RECORDS_FILE}; rerun the same command to resume",
            file=sys.stderr,
        )
        return 130
    finally:
        bar.close()
        writer.close()
    from ..tasks.grading import grading_stats

    results["grading"] = grading_stats()  # math-verify timeouts (graded 0) are counted here
    table = markdown_table(results)
    if set(AVERAGED) <= set(config["tasks"]):
        for model in results["models"].values():
            model["average"] = {
                k: sum(model["tasks"][t]["pass_at_k"][k]["mean"] for t in AVERAGED) / len(AVERAGED) for k in st.ks
            }
        table += "\n\n" + average_table(results, st.ks)
    write_outputs(out, results, table)
    print(table)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'pass_at_k.png'}")
    return 0


def average_table(results: dict, ks: list) -> str:
    """The unweighted mean of pass@k over `AVERAGED` (the official SAGE "Avg"), a row per model."""
    lines = [
        f"### average ({', '.join(AVERAGED)})",
        "",
        "| model | " + " | ".join(f"pass@{k}" for k in ks) + " |",
        "|---|" + "---:|" * len(ks),
    ]
    for label, model in results["models"].items():
        lines.append(f"| {label} | " + " | ".join(f"{100 * model['average'][k]:.1f}" for k in ks) + " |")
    return "\n".join(lines)


def _device(requested: str | None) -> str:
    if requested:
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
