"""`python -m benchmarks.profile_stages`: where the Triton loss spends its time, stage by stage.

At one point (shape, N, dtype, masked fraction) it runs fwd+bwd of the Triton backend on
both of its paths, the three-matmul path (the default configuration) and the two-pass path
(the same loss with sequence-level ratios), with `sage_kernels.triton.stage_timing` recording each
stage (logits GEMM, row stats, token stage, d(logits), each gradient GEMM; forward sweep,
backward d(logits), ...), and the bare GEMM floor (`providers.gemm-floor`: the three products
and nothing else). Per path: the median over the timed runs of every stage, the whole call,
the share of the whole, the TFLOP/s of each stage that is one N x D x V product (so a GEMM that
falls short, such as d(hidden) with its few output tiles, shows), the ratio to the floor, the
number of vocabulary slices d(hidden) was split into, and the peak memory above the inputs.
A further part (named, not run by default), ``three-matmul-1280``, runs the three-matmul path
at token chunks of 1280 rows instead of the ones its fp32 logits workspace budget gives
(`three_matmul.chunk_rows`: 640 at V 152k): the chunk-height lever (a taller d(hidden) GEMM and
half the roundings of a 16-bit weight gradient, for twice the workspace), and ``three-matmul-unsplit``
the path with d(hidden) as one product instead of its vocabulary slices (`gemm.sliced_mm_f32`).

Each part (a path, the floor) runs in a process of its own (`isolated.py`), at most
--part-timeout-s seconds: a part that fails or is cut short is reported as failed and the
others still run. Its row is appended to ``stages.jsonl`` and ``stages.md`` in --out is
rewritten from the rows so far as each part ends.

On CUDA the stages are timed with CUDA events (no sync between them); on CPU the kernels
run under TRITON_INTERPRET=1 (set here when it is not) and the wall clock times them, which
is only good for checking the harness at a tiny shape.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from . import isolated
from .measure import PeakMemory, machine
from .shapes import DTYPES, SHAPES, Point, make_inputs

REPO_ROOT = Path(__file__).resolve().parent.parent
#: path name -> the loss options that select it (on top of the benchmark's shared settings).
PATHS = {"three-matmul": {}, "two-pass": {"importance_sampling": "sequence"}}
FLOOR = "gemm-floor"
#: token rows per logits chunk of the tall-chunk part (`tiles.SweepTiles.chunk_n`).
TALL_CHUNK_ROWS = 1280
TALL = f"three-matmul-{TALL_CHUNK_ROWS}"
#: the stages that are one N_valid x D x V product (2 N_valid D V FLOP each): their TFLOP/s is printed,
#: so the device run shows which product falls short of the others (d(hidden)'s few output tiles).
PRODUCT_STAGES = ("logits GEMM", "forward sweep", "backward d(logits)", "grad_hidden GEMM", "grad_weight GEMM")
#: the three-matmul path with d(hidden) as one product (`tiles.SweepTiles.dh_slices` = 1): against the
#: default part, what the vocabulary split (`gemm.sliced_mm_f32`) gains on this device.
UNSPLIT = "three-matmul-unsplit"
#: what one process measures: a path, the path at tall chunks or unsplit, or the floor; the default ones.
PARTS = (*PATHS, TALL, UNSPLIT, FLOOR)
DEFAULT_PARTS = (*PATHS, FLOOR)


def parse_args(
    argv, prog: str = "python -m benchmarks.profile_stages", doc: str = __doc__, parts=PARTS, default=DEFAULT_PARTS
):
    """The point (device, shape, N, dtype, masked fraction), the parts to run and where to write;
    shared with `benchmarks.parity` (its own `prog`, `doc`, `parts` and `default` ones)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--shape", default=None, help=f"one of {sorted(SHAPES)}; default qwen2.5-7b (cuda), tiny (cpu)")
    parser.add_argument("--n", type=int, default=None, help="tokens N; default 16384 (cuda), 64 (cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 (cuda), fp32 (cpu)")
    parser.add_argument("--mask", type=float, default=0.0, help="masked fraction (default 0)")
    parser.add_argument(
        "--paths", default=",".join(default), help=f"comma-separated, from {list(parts)} (default {list(default)})"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per path after one warm-up (default 3)")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results"), help="output directory")
    parser.add_argument(
        "--part-timeout-s", type=float, default=None, help="seconds each part may take (default: no limit)"
    )
    parser.add_argument("--part", action="store_true", help=argparse.SUPPRESS)  # a child measuring one part
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
        if name not in parts:
            parser.error(f"--paths: unknown path {name!r}; expected some of {list(parts)}")
    if args.part and len(args.paths) != 1:
        parser.error("--part measures one of --paths")
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
    """Stage times (median ms over `repeats` runs), the whole call and the peak memory of one path
    (of the three-matmul path at `TALL_CHUNK_ROWS` for `TALL`: this process measures nothing else)."""
    from sage_kernels import fused_linear_sage_loss
    from sage_kernels.triton import gemm, stage_timing, three_matmul, tiles

    from .providers import SETTINGS

    if name == TALL:
        tiles.TILE_OVERRIDE["chunk_n"] = TALL_CHUNK_ROWS
    if name == UNSPLIT:
        tiles.TILE_OVERRIDE["dh_slices"] = 1
    options = PATHS["three-matmul" if name in (TALL, UNSPLIT) else name]

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
            **options,
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
        with stage_timing.recording(torch.device(point.device)) as recorder:
            _fwd_bwd(loss_fn, inputs)
            _sync(point.device)
            totals.append(1e3 * (time.perf_counter() - begin))
            stage_runs.append(recorder.milliseconds())
        used = meter.stop()
        peak = None if used is None or peak is None else max(peak, used)
    names = list(dict.fromkeys(n for run in stage_runs for n in run))
    stage_ms = {n: statistics.median(run.get(n, 0.0) for run in stage_runs) for n in names}
    grads = inputs.hidden.numel() * inputs.hidden.element_size() + inputs.weight.numel() * inputs.weight.element_size()
    valid = int(inputs.mask.sum())
    chunk = three_matmul.chunk_rows(point.n, valid, point.v) if "three-matmul" in taken else None
    dtype, device = inputs.hidden.dtype, torch.device(point.device)
    return {
        "path": name,
        "path_taken": sorted(taken),
        "chunk_rows": chunk,
        "dh_slices": (
            tiles.tiles_for(dtype).dh_slices or gemm.vocab_slices(device, dtype, min(chunk, valid), point.d, point.v)
        )
        if chunk
        else None,
        "valid_rows": valid,
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


def markdown(point: Point, rows: list[dict], command: str) -> str:
    """The stage table and the memory table of the rows so far (a part that failed says so)."""
    flop = 6 * point.n * point.d * point.v
    floor = next((r for r in rows if r["path"] == FLOOR and r["status"] == "ok"), None)
    floor_ms = floor["ms_total"] if floor else None
    info = next((r for r in rows if "torch" in r), {})
    on = info.get("gpu") or info.get("cpu", "?")
    lines = [
        f"Stage profile: {point.shape} (D {point.d}, V {point.v}), N {point.n}, {point.dtype}, "
        f"{point.mask_fraction:.0%} masked, fwd+bwd, on {on}; torch {info.get('torch', '?')}, "
        f"triton {info.get('triton', '?')}; commit {info.get('commit', '?')}.",
        "",
        f"Command: `{command}`",
        "",
        (
            f"GEMM floor (three bare products): {floor_ms:.1f} ms, {flop / floor_ms / 1e9:.3g} TFLOP/s (6NDV)."
            if floor_ms
            else "GEMM floor (three bare products): not measured."
        ),
        "",
        "| path | stage | ms | share | TFLOP/s | × floor |",
        "|---|---|---|---|---|---|",
    ]
    paths = [r for r in rows if r["path"] != FLOOR]
    for r in paths:
        if r["status"] != "ok":
            lines.append(f"| {r['path']} | {r['status']} | — | — | — | — |")
            continue
        product = 2 * r.get("valid_rows", point.n) * point.d * point.v  # one product over the valid rows
        for stage_name, ms in r["stages_ms"].items():
            rate = f"{product / ms / 1e9:.3g}" if stage_name in PRODUCT_STAGES and ms > 0 else "—"
            lines.append(f"| {r['path']} | {stage_name} | {ms:.2f} | {ms / r['ms_total']:.0%} | {rate} | — |")
        ratio = f"{r['ms_total'] / floor_ms:.2f}" if floor_ms else "—"
        rate = f"{flop / r['ms_total'] / 1e9:.3g}"
        lines.append(f"| {r['path']} | **whole call** | {r['ms_total']:.2f} | 100% | {rate} (6NDV) | {ratio} |")
    lines += [
        "",
        "TFLOP/s of a stage: 2·N_valid·D·V over its time where it is one such product (the GEMMs, the sweeps); "
        "d(hidden) split over `d(hidden) slices` vocabulary slices (`gemm.sliced_mm_f32`) where its output "
        "tiles alone would not fill the SMs.",
        "",
        "| path | ran as | token chunk | d(hidden) slices | peak MiB | extra MiB (without the gradients) | "
        "TFLOP/s (6NDV) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in paths:
        if r["status"] != "ok":
            continue
        peak = "—" if r["peak_mem_mib"] is None else f"{r['peak_mem_mib']:.0f}"
        extra = "—" if r["extra_mem_mib"] is None else f"{r['extra_mem_mib']:.0f}"
        chunk = f"{r['chunk_rows']} rows" if r.get("chunk_rows") else "—"
        slices = r.get("dh_slices") or "—"
        lines.append(
            f"| {r['path']} | {', '.join(r['path_taken'])} | {chunk} | {slices} | {peak} | {extra} | "
            f"{flop / r['ms_total'] / 1e9:.3g} |"
        )
    if floor is None:
        failed = [r["status"] for r in rows if r["path"] == FLOOR]
        lines += ["", f"GEMM floor: {failed[0] if failed else 'not run'}."]
    return "\n".join(lines) + "\n"


def measure_part(args, point: Point) -> dict:
    """The row of the one part `args.paths` names, measured in this process."""
    inputs = make_inputs(point)
    name = args.paths[0]
    if name == FLOOR:
        result = {"path": FLOOR, "ms_total": profile_floor(inputs, point, args.repeats)}
    else:
        result = profile_path(name, inputs, point, args.repeats)
    return {
        **result,
        "status": "ok",
        "shape": point.shape,
        "n": point.n,
        "d": point.d,
        "v": point.v,
        "dtype": point.dtype,
        "mask_fraction": point.mask_fraction,
        **machine(args.device),
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.device == "cpu":
        # must precede the first import of the kernels: @triton.jit reads it at definition time
        os.environ.setdefault("TRITON_INTERPRET", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "stages.jsonl"
    point = Point(args.shape, args.n, args.dtype, args.mask, args.device)
    if args.part:
        isolated.append_row(rows_path, measure_part(args, point))
        return 0
    command = ("python -m benchmarks.profile_stages " + " ".join(argv)).strip()
    rows = isolated.run_parts(
        f"{__package__}.profile_stages",
        argv,
        args.paths,
        rows_path,
        args.part_timeout_s,
        lambda rows: (out / "stages.md").write_text(markdown(point, rows, command)),
    )
    print((out / "stages.md").read_text())
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
