"""`python -m benchmarks.device_summary RESULTS`: the verdicts of a run_device.sh run, as lines of text.

Reads what the run's parts wrote to the folder RESULTS (stages.jsonl, parity.jsonl, loss.jsonl, and
the kernel tests' `pytest -v` logs, *-tests.log) and states the headline figures and whether each
target holds:

- the default (three-matmul) path's time over the GEMM floor's, from the stage profile and from the
  benchmark: target <= 1.3, goal 1.2;
- sage-triton's extra memory over naive's (target <= 1%) and its time over Liger's best (<= 0.5),
  the Triton rows of `report.TARGETS`, at the point the run measured; where naive was skipped (no
  room for it on an 80 GB card), our extra memory against N·V·4 bytes (`logits_bound`);
- the chunk-height lever: the three-matmul path at taller token chunks against its default ones;
- the d(hidden) split: the three-matmul path with its vocabulary slices against one product;
- each float64 parity part's verdict against tests/kernels/tolerances.py, with the worst element;
- the kernel tests' outcomes per file, as far as each pytest call got.

A figure a part did not produce is named as missing with the part's status. Imports no torch, so
run_device.sh rewrites summary.txt with it after every part, and once more when the run ends or
is cut short, in well under a second.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

from .report import TARGETS, target_verdicts

#: profile_stages' part names (not imported: that module imports torch). tests/bench checks them.
DEFAULT_PATH = "three-matmul"
FLOOR = "gemm-floor"
TALL_PREFIX = "three-matmul-"
UNSPLIT = "three-matmul-unsplit"
#: the Triton targets of `report.TARGETS` (peer, measure, bound), applied at whatever point the run measured,
#: and the goal under the floor's bound (<= 1.3).
TRITON_TARGETS = [(peer, measure, bound) for *_, ours, peer, measure, bound in TARGETS if ours == "sage-triton"]
FLOOR_BOUND = next(bound for peer, measure, bound in TRITON_TARGETS if peer == FLOOR)
FLOOR_GOAL = 1.2
#: fp32 [N, V] tensors the naive loss held at its peak, measured at cpu-small fwd+bwd (benchmarks/worker.py
#: rounds it up to NAIVE_LOGIT_COPIES for its skip estimate)
NAIVE_LOGIT_COPIES_MEASURED = 4.8
#: a pytest -v progress line: "FILE::TEST OUTCOME [ N%]", or under pytest-xdist "[gwK] [ N%] OUTCOME FILE::TEST".
OUTCOMES = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
PROGRESS = re.compile(
    rf"^(?:(?P<file>\S+\.py)::.*\s(?P<outcome>{OUTCOMES})\s+\[\s*\d+%\]"
    rf"|\[gw\d+\] \[\s*\d+%\] (?P<xoutcome>{OUTCOMES}) (?P<xfile>\S+\.py)::)"
)


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def floor_verdict(ratio: float) -> str:
    if ratio > FLOOR_BOUND:
        return f"target <= {FLOOR_BOUND}: not met"
    return f"target <= {FLOOR_BOUND}: met; goal {FLOOR_GOAL}: {'met' if ratio <= FLOOR_GOAL else 'not met'}"


def stage_lines(rows: list[dict]) -> list[str]:
    """The paths' whole-call times against the floor's, and the tall-chunk part against the default."""
    by_path = {r["path"]: r for r in rows}
    ok = {name: r for name, r in by_path.items() if r["status"] == "ok"}
    floor = ok.get(FLOOR)
    lines = []
    for name, r in by_path.items():
        if name == FLOOR:
            continue
        label = f"stage profile: {name}"
        if r["status"] != "ok":
            lines.append(f"{label}: {r['status']}")
            continue
        chunk = f", token chunk {r['chunk_rows']} rows" if r.get("chunk_rows") else ""
        extra = "" if r.get("extra_mem_mib") is None else f", extra {r['extra_mem_mib']:.0f} MiB"
        if floor is None:
            why = by_path[FLOOR]["status"] if FLOOR in by_path else "not in this run"
            lines.append(f"{label}: {r['ms_total']:.1f} ms{chunk}{extra}; GEMM floor {why}")
            continue
        ratio = r["ms_total"] / floor["ms_total"]
        line = f"{label}: {r['ms_total']:.1f} ms / GEMM floor {floor['ms_total']:.1f} ms = {ratio:.2f}{chunk}{extra}"
        lines.append(line + (f" ({floor_verdict(ratio)})" if name == DEFAULT_PATH else ""))
    default = ok.get(DEFAULT_PATH)
    unsplit = ok.get(UNSPLIT)
    if unsplit is not None and default is not None:
        lines.append(
            f"d(hidden) split: {default.get('dh_slices')} vocabulary slices {default['ms_total']:.1f} ms vs one "
            f"product {unsplit['ms_total']:.1f} ms = {default['ms_total'] / unsplit['ms_total']:.3f}"
        )
    for name, r in ok.items():
        if name.startswith(TALL_PREFIX) and name[len(TALL_PREFIX) :].isdigit() and default is not None:
            lines.append(
                f"chunk-height lever: {r['chunk_rows']}-row chunks {r['ms_total']:.1f} ms vs "
                f"{default['chunk_rows']}-row {default['ms_total']:.1f} ms = {r['ms_total'] / default['ms_total']:.3f}"
                + (
                    f", extra {r['extra_mem_mib']:.0f} vs {default['extra_mem_mib']:.0f} MiB"
                    if r.get("extra_mem_mib") is not None and default.get("extra_mem_mib") is not None
                    else ""
                )
            )
    return lines


def benchmark_lines(rows: list[dict]) -> list[str]:
    """sage-triton against the floor, naive and Liger (best) at the run's point (fwd+bwd, nothing masked)."""
    points = {(r["shape"], r["n"], r["dtype"]) for r in rows if r["mode"] == "fwd+bwd" and r["mask_fraction"] == 0}
    targets = [(*point, "sage-triton", *target) for point in sorted(points) for target in TRITON_TARGETS]
    lines = []
    vocab = {(r["shape"], r["n"], r["dtype"]): r["v"] for r in rows if "v" in r}
    for t in target_verdicts(rows, targets):
        head = f"benchmark {t['shape']} N {t['n']} {t['dtype']}: sage-triton / {t['peer']} {t['measure']}"
        if t["ratio"] is None and t["peer"] == "naive" and t["measure"] == "extra memory" and t["mine"] is not None:
            v = vocab.get((t["shape"], t["n"], t["dtype"]))
            lines.append(f"{head}: {t['verdict']}; " + logits_bound(t["mine"], t["n"], v, t["bound"]))
            continue
        if t["ratio"] is None:
            lines.append(f"{head}: {t['verdict']}")
            continue
        unit = "ms" if t["measure"] == "time" else "MiB"
        figures = f"{t['mine']:.1f} {unit} / {t['theirs']:.1f} {unit} = "
        if t["measure"] == "extra memory":
            figures += f"{t['ratio']:.2%} (target <= {t['bound']:.0%}: {t['verdict']})"
        elif t["peer"] == "gemm-floor":
            figures += f"{t['ratio']:.3f} ({floor_verdict(t['ratio'])})"
        else:
            figures += f"{t['ratio']:.3f} (target <= {t['bound']}: {t['verdict']})"
        lines.append(f"{head}: {figures}")
    return lines


def logits_bound(extra_mib: float, n: int, v: int | None, bound: float) -> str:
    """Where naive was not run (an 80 GB card has no room for it): our extra memory against one fp32
    [N, V] logits tensor (N·V·4 bytes), the least naive holds, so an upper bound on ours / naive."""
    if not v:
        return "V unknown: no bound"
    logits_mib = n * v * 4 / 2**20
    share = extra_mib / logits_mib
    head = f"ours {extra_mib:.1f} MiB / N·V·4 {logits_mib:.1f} MiB (one fp32 logits tensor) = {share:.2%}"
    if share <= bound:
        return f"{head}, so ours / naive <= {share:.2%} (target <= {bound:.0%}: met)"
    estimate = share / NAIVE_LOGIT_COPIES_MEASURED
    return (
        f"{head}, above the target's {bound:.0%}: not shown by this bound (naive held "
        f"{NAIVE_LOGIT_COPIES_MEASURED} such tensors at cpu-small, which would make it ~{estimate:.2%})"
    )


def parity_lines(rows: list[dict]) -> list[str]:
    """Each parity part's verdict, errors against their tolerances and worst elements."""
    lines = []
    for r in rows:
        label = f"float64 parity: {r['path']}"
        if r["status"] != "ok":
            lines.append(f"{label}: {r['status']}")
            continue
        tolerance = r.get("tolerance_grad")
        loss_tol = f" (tolerance {r['tolerance_loss'][0]:g} + {r['tolerance_loss'][1]:g} |loss|)" if tolerance else ""
        grad_tol = f" (tolerance {tolerance:g})" if tolerance else ""
        parts = [f"loss error {r['err_loss_abs']:.2e}{loss_tol}"]
        for name, symbol in (("weight", "W"), ("hidden", "h")):
            worst = r[f"worst_grad_{name}"]
            parts.append(
                f"d({name}) error {r[f'err_grad_{name}_rel']:.2e}{grad_tol}, worst {symbol}[{worst['row']}, "
                f"{worst['col']}] {worst['actual']:.6g} vs {worst['expected']:.6g}"
            )
        lines.append(f"{label} (ran as {', '.join(r['path_taken'])}): {r['verdict']}; " + "; ".join(parts))
    return lines


def outcome_counts(log: str) -> dict[str, Counter]:
    """Outcomes per test file of a `pytest -v` log (with or without pytest-xdist), in file order."""
    counts: dict[str, Counter] = {}
    for line in log.splitlines():
        match = PROGRESS.match(line.strip())
        if match:
            name = match["file"] or match["xfile"]
            counts.setdefault(name, Counter())[(match["outcome"] or match["xoutcome"]).lower()] += 1
    return counts


def kernel_test_lines(results: Path) -> list[str]:
    lines = []
    for log in sorted(results.glob("*-tests.log")):
        counts = outcome_counts(log.read_text(errors="replace"))
        if not counts:
            lines.append(f"{log.stem}: no test ran")
        for name, outcome in counts.items():
            lines.append(f"{log.stem}: {name}: " + ", ".join(f"{n} {kind}" for kind, n in sorted(outcome.items())))
    return lines


def summary(results: Path) -> list[str]:
    return [
        *stage_lines(read_rows(results / "stages.jsonl")),
        *benchmark_lines(read_rows(results / "loss.jsonl")),
        *parity_lines(read_rows(results / "parity.jsonl")),
        *kernel_test_lines(results),
    ]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) != 1:
        print("usage: python -m benchmarks.device_summary RESULTS_DIR", file=sys.stderr)
        return 2
    print("\n".join(summary(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
