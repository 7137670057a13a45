"""`python -m benchmarks.profile_stages`: where the Triton loss spends its time, stage by stage.

At one point (shape, N, dtype, masked fraction) it runs fwd+bwd of the Triton backend on
both of its paths, the three-matmul path (the default configuration) and the two-pass path
(the same loss with sequence-level ratios), with `sage_kernels.triton.stages` recording each
stage (logits GEMM, row stats, token stage, d(logits), each gradient GEMM; forward sweep,
backward d(logits), ...), and the bare GEMM floor (`providers.gemm-floor`: the three products
and nothing else). Per path: the median over the timed runs of every stage, the whole call,
the share of the whole and the ratio to the floor, and the peak memory above the inputs.
Rows go to ``stages.jsonl`` and a markdown table to ``stages.md`` in --out.

On CUDA the stages are timed with CUDA events (no sync between them); on CPU the kernels
run under TRITON_INTERPRET=1 (set here when it is not) and the wall clock times them, which
is only good for checking the harness at a tiny shape.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from .measure import PeakMemory, machine
from .shapes import DTYPES, SHAPES, Point, make_inputs

REPO_ROOT = Path(__file__).resolve().parent.parent
#: path name -> the loss options that select it (on top of the benchmark's shared settings).
PATHS = {"three-matmul": {}, "two-pass": {"importance_sampling": "sequence"}}


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_stages", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--shape", default=None, help=f"one of {sorted(SHAPES)}; default qwen2.5-7b (cuda), tiny (cpu)")
    parser.add_argument("--n", type=int, default=None, help="tokens N; default 16384 (cuda), 64 (cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 (cuda), fp32 (cpu)")
    parser.add_argument("--mask", type=float, default=0.0, help="masked fraction (default 0)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, from {list(PATHS)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per path after one warm-up (default 3)")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results"), help="output directory")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    cuda = args.device == "cuda"
    args.shape = args.shape or ("qwen2.5-7b" if cuda else "tiny")
    args.n = args.n or (16384 if cuda else 64)
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.paths = [p for p in args.paths.split(",") if p]
    for name in args.paths:
        if name not in PATHS:
            parser.error(f"--paths: unknown path {name!r}; expected some of {list(PATHS)}")
    return args


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _fwd_bwd(loss_fn, inputs):
    """One fwd+bwd from fresh leaves (gradients of hidden and weight)."""
    hidden = inputs.hidden.detach().requires_grad_()
    weight = inputs.weight.detach().requires_grad_()
    loss_fn(hidden, weight).backward()


def profile_path(name: str, inputs, point: Point, repeats: int) -> dict:
    """Stage times (median ms over `repeats` runs), the whole call and the peak memory of one path."""
    from sage_kernels import fused_linear_sage_loss
    from sage_kernels.triton import stages, three_matmul

    from .providers import SETTINGS

    def loss_fn(hidden, weight):
        return fused_linear_sage_loss(
            hidden,
            weight,
            inputs.token_ids,
            inputs.mask,
            inputs.advantages,
            old_logp=inputs.old_logp,
            ref_logp=inputs.ref_logp,
            backend="triton",
            guide="none",
            **SETTINGS,
            **PATHS[name],
        ).loss

    before = three_matmul.PATHS_TAKEN.copy()
    _fwd_bwd(loss_fn, inputs)  # warm-up: compiles the kernels
    taken = three_matmul.PATHS_TAKEN - before
    stage_runs, totals, peak = [], [], 0
    meter = PeakMemory(point.device)
    for _ in range(repeats):
        meter.start()
        _sync(point.device)
        begin = time.perf_counter()
        with stages.recording(torch.device(point.device)) as recorder:
            _fwd_bwd(loss_fn, inputs)
            _sync(point.device)
            totals.append(1e3 * (time.perf_counter() - begin))
            stage_runs.append(recorder.milliseconds())
        used = meter.stop()
        peak = None if used is None or peak is None else max(peak, used)
    names = list(dict.fromkeys(n for run in stage_runs for n in run))
    stage_ms = {n: statistics.median(run.get(n, 0.0) for run in stage_runs) for n in names}
    grads = inputs.hidden.numel() * inputs.hidden.element_size() + inputs.weight.numel() * inputs.weight.element_size()
    return {
        "path": name,
        "path_taken": sorted(taken),
        "ms_total": statistics.median(totals),
        "stages_ms": stage_ms,
        "peak_mem_mib": None if peak is None else peak / 2**20,
        "extra_mem_mib": None if peak is None else max(peak - grads, 0) / 2**20,
    }


def profile_floor(inputs, point: Point, repeats: int) -> float:
    """Median ms of the three bare GEMMs (fwd+bwd of the gemm-floor provider)."""
    from .providers import PROVIDERS

    floor = PROVIDERS["gemm-floor"].loss
    _fwd_bwd(lambda h, w: floor(_with(inputs, h, w)), inputs)
    times = []
    for _ in range(repeats):
        _sync(point.device)
        begin = time.perf_counter()
        _fwd_bwd(lambda h, w: floor(_with(inputs, h, w)), inputs)
        _sync(point.device)
        times.append(1e3 * (time.perf_counter() - begin))
    return statistics.median(times)


def _with(inputs, hidden, weight):
    from .shapes import Inputs

    return Inputs(hidden, weight, inputs.token_ids, inputs.mask, inputs.advantages, inputs.old_logp, inputs.ref_logp)


def markdown(point: Point, results: list[dict], floor_ms: float, command: str, info: dict) -> str:
    flop = 6 * point.n * point.d * point.v
    lines = [
        f"Stage profile: {point.shape} (D {point.d}, V {point.v}), N {point.n}, {point.dtype}, "
        f"{point.mask_fraction:.0%} masked, fwd+bwd, on {info.get('gpu') or info['cpu']}; torch {info['torch']}, "
        f"triton {info['triton']}; commit {info['commit']}.",
        "",
        f"Command: `{command}`",
        "",
        f"GEMM floor (three bare products): {floor_ms:.1f} ms, {flop / floor_ms / 1e9:.3g} TFLOP/s (6NDV).",
        "",
        "| path | stage | ms | share | × floor |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        for stage_name, ms in r["stages_ms"].items():
            lines.append(f"| {r['path']} | {stage_name} | {ms:.2f} | {ms / r['ms_total']:.0%} | — |")
        lines.append(f"| {r['path']} | **whole call** | {r['ms_total']:.2f} | 100% | {r['ms_total'] / floor_ms:.2f} |")
    lines += [
        "",
        "| path | ran as | peak MiB | extra MiB (without the gradients) | TFLOP/s (6NDV) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        peak = "—" if r["peak_mem_mib"] is None else f"{r['peak_mem_mib']:.0f}"
        extra = "—" if r["extra_mem_mib"] is None else f"{r['extra_mem_mib']:.0f}"
        lines.append(
            f"| {r['path']} | {', '.join(r['path_taken'])} | {peak} | {extra} | {flop / r['ms_total'] / 1e9:.3g} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.device == "cpu":
        # must precede the first import of the kernels: @triton.jit reads it at definition time
        os.environ.setdefault("TRITON_INTERPRET", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    point = Point(args.shape, args.n, args.dtype, args.mask, args.device)
    inputs = make_inputs(point)
    info = machine(args.device)
    results = [profile_path(name, inputs, point, args.repeats) for name in args.paths]
    floor_ms = profile_floor(inputs, point, args.repeats)
    command = "python -m benchmarks.profile_stages " + " ".join(argv)
    rows = [
        {
            **r,
            "shape": point.shape,
            "n": point.n,
            "d": point.d,
            "v": point.v,
            "dtype": point.dtype,
            "mask_fraction": point.mask_fraction,
            "floor_ms": floor_ms,
            **info,
        }
        for r in results
    ]
    (out / "stages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = markdown(point, results, floor_ms, command.strip(), info)
    (out / "stages.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
