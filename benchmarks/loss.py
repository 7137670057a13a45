"""`sage-bench loss` / `python -m benchmarks.loss`: the fused SAGE loss against its peers.

Every point (shape, N, dtype, masked fraction) runs in a fresh worker process
(`benchmarks/worker.py`; on CUDA one per provider, so a CUDA fault costs only that provider's
rows) that measures each provider in each mode on the same inputs. The rows (JSONL, long
format) and a markdown report with the ratio of ours to each peer are written to --out as each
worker ends, and a plot of time and memory against N at the end. A provider that cannot run
here (its package or device absent) and rows past --time-limit-s are reported as skipped by this
process, with no worker started for them. Without --shapes, the device's default plan of
`shapes.DEFAULT_PLANS` runs; on CPU it starts no row after `DEFAULT_PLAN_LIMIT_S` (unless
--time-limit-s says otherwise), so it ends within 10 minutes on a 2-core CPU, and since ours and the
GEMM floor run first at every point (`worker_groups`), a row the limit skips is a peer's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import report
from .measure import MACHINE_KEYS
from .providers import PROVIDERS
from .shapes import DEFAULT_PLANS, DTYPES, SHAPES, Point, check_point
from .worker import base_row

MODES = ("fwd", "fwd+bwd")
#: seconds after which the default plan starts no row, per device (None: no limit): on CPU the last row
#: started (a qwen2.5-0.5b peer's, up to a minute) ends within 10 minutes.
DEFAULT_PLAN_LIMIT_S = {"cpu": 510.0, "cuda": None}
REPO_ROOT = Path(__file__).resolve().parent.parent


def _csv(kind):
    return lambda text: [kind(item) for item in text.split(",") if item]


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sage-bench loss", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available, else cpu"
    )
    parser.add_argument(
        "--shapes", type=_csv(str), help=f"comma-separated, from {sorted(SHAPES)}; default: the device's plan"
    )
    parser.add_argument(
        "--n",
        type=_csv(int),
        help="token counts N (multiples of 1024 above 1024); default: the plan's, or 2048 with --shapes",
    )
    parser.add_argument("--modes", type=_csv(str), help=f"from {list(MODES)}; default: both (with --shapes)")
    parser.add_argument("--masks", type=_csv(float), help="masked fractions; default: 0,0.5 (with --shapes)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: fp32 on cpu, bf16 on cuda")
    parser.add_argument(
        "--providers",
        type=_csv(str),
        default=list(PROVIDERS),
        help=f"comma-separated, from {list(PROVIDERS)}; default: all, in that order (ours and the floor first)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row at most (default 3)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=60.0,
        help="seconds of runs per row before stopping early, at least one run (default 60)",
    )
    parser.add_argument(
        "--time-limit-s",
        type=float,
        help="rows not started within this many seconds are reported as skipped (default plan on CPU: "
        f"{DEFAULT_PLAN_LIMIT_S['cpu']:.0f})",
    )
    parser.add_argument(
        "--out", default="benchmarks/results", help="output directory (relative to the working directory)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in args.providers:
        if name not in PROVIDERS:
            parser.error(f"--providers: unknown provider {name!r}; expected some of {list(PROVIDERS)}")
    for mode in args.modes or ():
        if mode not in MODES:
            parser.error(f"--modes: unknown mode {mode!r}; expected some of {list(MODES)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.time_limit_s is None and not args.shapes:
        args.time_limit_s = DEFAULT_PLAN_LIMIT_S[args.device]
    return args


def plan(args) -> list[tuple[Point, list[str]]]:
    """(point, modes) pairs: the device's default plan, or the cross product of the flags."""
    if args.shapes:
        entries = [
            (shape, args.n or [2048], args.modes or list(MODES), args.masks or [0.0, 0.5]) for shape in args.shapes
        ]
    else:
        entries = [
            (shape, args.n or ns, args.modes or modes, args.masks or masks)
            for shape, ns, modes, masks in DEFAULT_PLANS[args.device]
        ]
    points = []
    for shape, ns, modes, masks in entries:
        for n in ns:
            for mask in masks:
                point = Point(shape, n, args.dtype, mask, args.device)
                check_point(point)
                points.append((point, modes))
    return points


def run_worker(points: list[tuple[Point, list[str]]], providers: list[str], args, rows_path: Path) -> list[dict]:
    """Run `providers` at `points` in a fresh process; rows it could not write are reported as failed."""
    spec = {
        "points": [{"point": dataclasses.asdict(p), "modes": modes} for p, modes in points],
        "providers": providers,
        "repeats": args.repeats,
        "budget_s": args.budget_s,
        "seed": args.seed,
        "deadline": args.deadline,
    }
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    before = rows_path.stat().st_size
    command = [sys.executable, "-m", f"{__package__}.worker", json.dumps(spec), str(rows_path)]
    proc = subprocess.run(command, env=env)
    with open(rows_path) as f:
        f.seek(before)
        rows = [json.loads(line) for line in f if line.strip()]
    done = {(r["shape"], r["n"], r["mask_fraction"], r["provider"], r["mode"]) for r in rows}
    for point, modes in points:
        for provider in providers:
            for mode in modes:
                if (point.shape, point.n, point.mask_fraction, provider, mode) not in done:
                    rows.append(
                        {
                            **base_row(point, provider, mode),
                            "status": f"failed: worker exited with code {proc.returncode}",
                        }
                    )
    return rows


def worker_groups(points: list, providers: list[str], device: str) -> list[tuple[list, list[str]]]:
    """(points, providers) of each worker, in the order they run. CUDA: one worker per provider, at every
    point (a CUDA fault poisons only its own process, and each peer compiles once). CPU: a worker per
    point (a clean heap for the memory measurement), first ours and the GEMM floor at every point, then
    the peers at every point, so that a time limit cuts a peer's row before any of ours."""
    if device == "cuda":
        return [(points, [name]) for name in providers]
    first = [name for name in providers if PROVIDERS[name].ours or name == "gemm-floor"]
    rest = [name for name in providers if name not in first]
    return [([p], names) for names in (first, rest) if names for p in points]


def skipped_rows(points: list[tuple[Point, list[str]]], provider: str, reason: str) -> list[dict]:
    """The rows of `provider` at `points`, reported as skipped for `reason` without measuring."""
    rows = [{**base_row(p, provider, mode), "status": f"skipped: {reason}"} for p, modes in points for mode in modes]
    print(f"{provider}: skipped: {reason} (no worker started)", file=sys.stderr, flush=True)
    return rows


def _write_report(rows: list[dict], rows_path: Path, out: Path, command: str, args, started: float) -> str:
    """loss.jsonl (with the rows of any worker that died) and loss.md from the rows so far."""
    machine = next((r for r in rows if "cpu" in r), None)
    for r in rows:  # rows written by the parent for a dead worker borrow the machine fields
        if machine is not None:
            for key in MACHINE_KEYS:
                r.setdefault(key, machine[key])
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ours = [name for name in args.providers if PROVIDERS[name].ours and not name.endswith("-branch")]
    text = report.markdown(rows, command, ours) if machine else report.results_table(rows)
    text += f"\nTotal wall time: {time.perf_counter() - started:.0f} s.\n"
    (out / "loss.md").write_text(text)
    return text


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "sage-bench loss " + shlex.join(argv) if argv else "sage-bench loss"
    started = time.perf_counter()
    args.deadline = None if args.time_limit_s is None else time.time() + args.time_limit_s
    rows = []
    # Workers append to loss.jsonl as they measure, so a run cut short keeps its rows; it is
    # rewritten after each worker with the rows of any worker that died.
    rows_path = out / "loss.jsonl"
    rows_path.write_text("")
    points = plan(args)
    missing = {name: PROVIDERS[name].unavailable(args.device) for name in args.providers}
    for group, providers in worker_groups(points, args.providers, args.device):
        for name in providers:
            if missing[name]:
                rows += skipped_rows(group, name, missing[name])
        late = args.deadline is not None and time.time() > args.deadline
        runnable = [name for name in providers if not missing[name]]
        if late:
            for name in runnable:
                rows += skipped_rows(group, name, "past --time-limit-s")
        elif runnable:
            rows += run_worker(group, runnable, args, rows_path)
        text = _write_report(rows, rows_path, out, command, args, started)  # as each worker ends
    problem = report.plot(rows, str(out / "loss.png"))
    print(text)
    print(problem or f"wrote {out / 'loss.jsonl'}, {out / 'loss.md'}, {out / 'loss.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
