"""Held-out pass@k before and after RL over seeds, from the runs' own evaluations.

    python -m sage_train.study.before_after RUN_DIR [RUN_DIR ...] [--split test] [--k 1,4] [--out FILE]

Each run evaluates the same problems with the same number of samples before and after its RL
steps (eval_before.json, eval_after.json: each problem's counts, `sage_train.run.evaluate_once`),
so after - before is paired per (seed, problem); the runs' seeds and the problems are the two
crossed random factors, and the interval is the studies' one (`study.endpoints.endpoint_rows`).
The runs must share their problems (every seed's held-out set is the same) and their sample count.
FILE (JSON) keeps every (seed, problem) count, so anyone can recompute the intervals.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import load_yaml
from ..eval.evaluate import mean_pass_at_k
from ..run_files import RUN_FILES
from ..safe_files import write_file
from .endpoints import endpoint_rows


def run_record(run_dir: Path, split: str) -> dict:
    """{seed, problems (ids), n, before, after (correct per problem), wall_time_s, reward_first,
    reward_last} of one finished run; ValueError naming the file that lacks what is needed."""
    summary_path = run_dir / RUN_FILES.summary
    if not summary_path.is_file():
        raise ValueError(f"{run_dir}: no summary.json (the run has not finished)")
    summary = json.loads(summary_path.read_text())
    record = {"run": run_dir.name, "seed": load_yaml(run_dir / RUN_FILES.config).seed}
    for when in ("before", "after"):
        evaluation = (summary.get(f"eval_{when}") or {}).get(split) or {}
        if "counts" not in evaluation:
            raise ValueError(f"{run_dir}: eval_{when}.json has no per-problem counts for split {split!r}")
        ids = [problem for problem, _, _ in evaluation["counts"]]
        if record.setdefault("problems", ids) != ids:
            raise ValueError(f"{run_dir}: evaluated other problems after RL than before")
        record["n"] = evaluation["samples"]
        record[when] = [correct for _, _, correct in evaluation["counts"]]
    record.update({key: summary[key] for key in ("wall_time_s", "reward_first", "reward_last")})
    return record


def before_after(run_dirs: list[Path], split: str, ks: list[int]) -> dict:
    """{"split", "ks", "problems", "runs" (`run_record` each, with pass@k before / after), "counts"
    ({"before"|"after": {seed: {"n", "correct"}}}, the studies' layout), "endpoints" (after - before
    per k, crossed interval)}."""
    runs = [run_record(Path(d), split) for d in run_dirs]
    if not runs:
        raise ValueError("no run directories given")
    for run in runs[1:]:
        if run["problems"] != runs[0]["problems"] or run["n"] != runs[0]["n"]:
            raise ValueError(f"{run['run']} evaluated other problems or another sample count than {runs[0]['run']}")
    seeds = [run["seed"] for run in runs]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"two runs share a seed: {seeds}")
    if max(ks) > runs[0]["n"]:
        raise ValueError(f"k must be <= the {runs[0]['n']} samples per problem, got {max(ks)}")
    counts = {when: {str(r["seed"]): {"n": r["n"], "correct": r[when]} for r in runs} for when in ("before", "after")}
    for run in runs:
        for when in ("before", "after"):
            pairs = [(run["n"], c) for c in run[when]]
            run[f"pass_at_k_{when}"] = {str(k): mean_pass_at_k(pairs, k) for k in ks}
    return {
        "split": split,
        "ks": ks,
        "problems": runs[0]["problems"],
        "runs": runs,
        "counts": counts,
        "endpoints": endpoint_rows(counts, [{"arm": "after", "versus": "before", "k": ks}]),
    }


def markdown(result: dict) -> str:
    """The per-seed table and the after - before interval per k, in points."""
    ks = result["ks"]
    head = " | ".join(f"pass@{k} before -> after" for k in ks)
    lines = [f"| seed | {head} | reward first -> last | wall time |", "|---" * (len(ks) + 3) + "|"]
    for run in result["runs"]:
        cells = " | ".join(f"{run['pass_at_k_before'][str(k)]:.3f} -> {run['pass_at_k_after'][str(k)]:.3f}" for k in ks)
        lines.append(
            f"| {run['seed']} | {cells} | {run['reward_first']:.3f} -> {run['reward_last']:.3f} | "
            f"{run['wall_time_s'] / 60:.1f} min |"
        )
    lines.append("")
    for row in result["endpoints"]:
        if row.get("ci_low") is None:
            lines.append(f"after - before, pass@{row['k']}: {100 * row['mean']:+.1f} points ({row.get('note')})")
        else:
            lines.append(
                f"after - before, pass@{row['k']}: {100 * row['mean']:+.1f} points, 95% interval "
                f"[{100 * row['ci_low']:+.1f}, {100 * row['ci_high']:+.1f}] ({len(row['seeds'])} seeds x "
                f"{len(result['problems'])} problems, crossed)"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sage_train.study.before_after", description=__doc__.splitlines()[0]
    )
    parser.add_argument("runs", nargs="+", type=Path, help="finished run directories (one per seed)")
    parser.add_argument("--split", default="test", choices=("test", "train"))
    parser.add_argument("--k", default="1", help="comma-separated k (default 1)")
    parser.add_argument("--out", type=Path, help="write the result (with every count) as JSON here")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = before_after(args.runs, args.split, [int(k) for k in args.k.split(",")])
    except ValueError as error:
        print(f"before_after: {error}", file=sys.stderr)
        return 2
    if args.out:
        write_file(args.out, json.dumps(result, indent=1) + "\n")
    print(markdown(result), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
