"""Benchmark points in a process of their own: every provider and mode on the same inputs.

`python -m benchmarks.worker SPEC_JSON ROWS_JSONL` appends one row per (point, provider,
mode) to ROWS_JSONL as soon as it is measured, so a crash loses only the rows not yet
written. On CPU the parent starts one worker per point: a clean heap for the memory
measurement, and a provider that crashes cannot take the other points with it. On CUDA
it starts one worker per provider, at every point: a CUDA fault (which poisons the process)
costs only that provider's rows, and torch.compile compiles each peer once.

Errors are measured on a slice of about ERROR_TOKENS tokens (every k-th position of the
first two completions, so the masked fraction is kept) with the full D and V, in the
benchmark dtype, against the reference backend run in float64 on the same slice.

Warm-up: each provider runs on that slice and on a second, smaller one of another shape
before it is timed. Two shapes make torch.compile mark the sizes dynamic, so the graphs it
compiled there serve the full size and no timed run compiles; each row records the
compilations seen during its timed runs (`compiles_in_timing`, 0 when all is well).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time

import torch

from sage_kernels import fused_linear_sage_loss

from .measure import available_memory, machine, relative_error, time_runs
from .providers import PROVIDERS, SETTINGS
from .shapes import Inputs, Point, make_inputs

ERROR_TOKENS = 256
#: float32 [N, V] tensors the naive reference holds at its peak (logits, log-softmax, probabilities,
#: their product, the backward's gradient): 4.8 measured at cpu-small fwd+bwd, rounded up.
NAIVE_LOGIT_COPIES = 6
#: the naive provider is skipped when its estimate exceeds this fraction of the free memory.
NAIVE_MEMORY_FRACTION = 0.5


def error_slice(x: Inputs, rows: int = 2, tokens: int = ERROR_TOKENS) -> Inputs:
    """About `tokens` tokens: every k-th position of the first `rows` completions."""
    B, L = x.token_ids.shape
    rows = min(rows, B)
    step = max(L * rows // tokens, 1)

    def cut(t):
        return t[:rows, ::step].contiguous()

    return Inputs(
        cut(x.hidden),
        x.weight,
        cut(x.token_ids),
        cut(x.mask),
        x.advantages[:rows].contiguous(),
        cut(x.old_logp),
        cut(x.ref_logp),
    )


def warmup_slice(x: Inputs) -> Inputs:
    """A slice of another shape than `error_slice`'s (one more row, fewer tokens); sizes of 1
    are kept, since torch.compile specialises them."""
    return error_slice(x, rows=3, tokens=ERROR_TOKENS // 2)


def run_once(provider, x: Inputs, mode: str):
    """The provider's loss (and gradients for fwd+bwd) on fresh leaves of x's hidden and weight."""
    leaves = dataclasses.replace(
        x,
        hidden=x.hidden.detach().requires_grad_(mode == "fwd+bwd"),
        weight=x.weight.detach().requires_grad_(mode == "fwd+bwd"),
    )
    if mode == "fwd":
        with torch.no_grad():
            return provider.loss(leaves), None, None
    loss = provider.loss(leaves)
    loss.backward()
    return loss, leaves.hidden.grad, leaves.weight.grad


def float64_result(x: Inputs, guide: str):
    h = x.hidden.detach().double().requires_grad_()
    w = x.weight.detach().double().requires_grad_()
    out = fused_linear_sage_loss(
        h,
        w,
        x.token_ids,
        x.mask,
        x.advantages,
        old_logp=x.old_logp,
        ref_logp=x.ref_logp,
        backend="reference",
        **{**SETTINGS, "guide": guide},
    )
    out.loss.backward()
    return out.loss.detach(), h.grad, w.grad


def skip_reason(provider, point: Point) -> str | None:
    reason = provider.unavailable(point.device)
    if reason is None and provider.name == "naive":
        need = NAIVE_LOGIT_COPIES * point.n * point.v * 4
        free = available_memory(point.device)
        if need > NAIVE_MEMORY_FRACTION * free:
            reason = (
                f"needs ~{need / 2**30:.0f} GiB ({NAIVE_LOGIT_COPIES} [N, V] fp32 copies), {free / 2**30:.0f} GiB free"
            )
    return reason


def slice_errors(provider, sliced: Inputs, mode: str, reference) -> dict:
    """The provider's errors on the slice against the float64 reference (none for gemm-floor)."""
    loss, grad_h, grad_w = run_once(provider, sliced, mode)
    if provider.guide is None:
        return {}
    loss64, grad_h64, grad_w64 = reference(provider.guide)
    return {
        "err_loss_abs": abs(loss.double().item() - loss64.item()),
        "err_grad_hidden_rel": relative_error(grad_h, grad_h64),
        "err_grad_weight_rel": relative_error(grad_w, grad_w64),
    }


def measure(
    provider, point: Point, x: Inputs, sliced: Inputs, mode: str, reference, repeats: int, budget_s: float
) -> dict:
    row = slice_errors(provider, sliced, mode, reference)
    run_once(provider, warmup_slice(x), mode)
    leaves = dataclasses.replace(
        x, hidden=x.hidden.requires_grad_(mode == "fwd+bwd"), weight=x.weight.requires_grad_(mode == "fwd+bwd")
    )

    def run():
        if mode == "fwd":
            with torch.no_grad():
                provider.loss(leaves)
        else:
            provider.loss(leaves).backward()

    def reset():
        leaves.hidden.grad = leaves.weight.grad = None

    compiles = _compilations()
    row.update(time_runs(run, reset, point.device, repeats=repeats, budget_s=budget_s))
    row["compiles_in_timing"] = _compilations() - compiles
    if row["peak_mem_mib"] is not None:
        # Beyond the gradients too (they are outputs, in the input dtype): the workspace alone.
        grads = x.hidden.nbytes + x.weight.nbytes if mode == "fwd+bwd" else 0
        row["extra_mem_mib"] = row["peak_mem_mib"] - grads / 2**20
    ndv = point.n * point.d * point.v
    seconds = row["ms_p50"] / 1e3
    row["tflops_6ndv"] = (6 if mode == "fwd+bwd" else 2) * ndv / seconds / 1e12
    row["tflops_8ndv"] = (8 if mode == "fwd+bwd" else 2) * ndv / seconds / 1e12
    row["tokens_per_s"] = point.n / seconds
    return row


def _compilations() -> int:
    """Frames torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def run_point(point: Point, modes: list[str], spec: dict, rows) -> None:
    """Measure every provider of `spec` in each of `modes` at `point`; write rows as they come."""
    info = machine(point.device)
    x = make_inputs(point, seed=spec["seed"])
    sliced = error_slice(x)
    references = {}

    def reference(guide):
        if guide not in references:
            references[guide] = float64_result(sliced, guide)
        return references[guide]

    for name in spec["providers"]:
        provider = PROVIDERS[name]
        reason = skip_reason(provider, point)
        for mode in modes:
            row = {
                **base_row(point, name, mode),
                "err_tokens": sliced.token_ids.numel(),
                **info,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            if spec["deadline"] is not None and time.time() > spec["deadline"]:
                row["status"] = "skipped: past --time-limit-s"
            elif reason:
                row["status"] = f"skipped: {reason}"
            else:
                try:
                    with matmul_tf32(provider.tf32):
                        measured = measure(
                            provider, point, x, sliced, mode, reference, spec["repeats"], spec["budget_s"]
                        )
                    row.update(measured)
                    row["status"] = "ok"
                except Exception as error:  # a provider failing is a result to report, not a crash
                    first_line = (str(error).splitlines() or [""])[0][:200]
                    row["status"] = f"failed: {type(error).__name__}: {first_line}"
                    if point.device == "cuda":
                        torch.cuda.empty_cache()  # an out-of-memory provider must not starve the next one
            rows.write(json.dumps(row) + "\n")
            rows.flush()
            print(describe(row), file=sys.stderr, flush=True)


def main(spec: dict, rows_path: str) -> None:
    with open(rows_path, "a") as rows:
        for entry in spec["points"]:
            run_point(Point(**entry["point"]), entry["modes"], spec, rows)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def base_row(point: Point, provider: str, mode: str) -> dict:
    """The fields that name a row: op, provider, point (shape, N, D, V, dtype, mask, device), mode, and
    whether fp32 matmuls ran with TF32 (CUDA only; None on CPU, where the setting does nothing)."""
    return {
        "op": "sage_loss",
        "provider": provider,
        **dataclasses.asdict(point),
        "d": point.d,
        "v": point.v,
        "mode": mode,
        "tf32": PROVIDERS[provider].tf32 if point.device == "cuda" else None,
    }


@contextlib.contextmanager
def matmul_tf32(on: bool):
    """fp32 matmuls with TF32 `on` (cuBLAS) while a provider runs, the previous setting restored after."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def describe(row: dict) -> str:
    head = (
        f"{row['shape']} N={row['n']} {row['dtype']} mask={row['mask_fraction']} {row['mode']:7} {row['provider']:22}"
    )
    if row["status"] != "ok":
        return f"{head} {row['status']}"
    return f"{head} {row['ms_p50']:10.1f} ms  {row['peak_mem_mib'] or 0:9.1f} MiB  runs={row['runs']}"


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
