"""One benchmark point in its own process: every provider and mode on the same inputs.

`python -m benchmarks.worker SPEC_JSON ROWS_JSONL` appends one row per (provider, mode) to
ROWS_JSONL as soon as it is measured, so a crash loses only the rows not yet written. A
fresh process per point gives each point a clean heap and keeps a provider that crashes
from taking the other points with it.

Errors are measured on a slice of ERROR_TOKENS tokens (every k-th position of the first
completion, so the masked fraction is kept) with the full D and V, in the benchmark dtype,
against the reference backend run in float64 on the same slice. Running that slice first
also warms each provider up (torch.compile, lazy set-up) before it is timed.
"""

from __future__ import annotations

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
#: their product and the backward's gradient), as measured at the cpu-small shape.
NAIVE_LOGIT_COPIES = 6
#: the naive provider is skipped when its estimate exceeds this fraction of the free memory.
NAIVE_MEMORY_FRACTION = 0.5


def error_slice(x: Inputs) -> Inputs:
    step = max(x.token_ids.shape[1] // ERROR_TOKENS, 1)

    def cut(t):
        return t[:1, ::step].contiguous()

    return Inputs(cut(x.hidden), x.weight, cut(x.token_ids), cut(x.mask), x.advantages[:1].contiguous(),
                  cut(x.old_logp), cut(x.ref_logp))


def run_once(provider, x: Inputs, mode: str):
    """The provider's loss (and gradients for fwd+bwd) on fresh leaves of x's hidden and weight."""
    leaves = dataclasses.replace(x, hidden=x.hidden.detach().requires_grad_(mode == "fwd+bwd"),
                                 weight=x.weight.detach().requires_grad_(mode == "fwd+bwd"))
    if mode == "fwd":
        with torch.no_grad():
            return provider.loss(leaves), None, None
    loss = provider.loss(leaves)
    loss.backward()
    return loss, leaves.hidden.grad, leaves.weight.grad


def float64_result(x: Inputs, guide: str):
    h = x.hidden.detach().double().requires_grad_()
    w = x.weight.detach().double().requires_grad_()
    out = fused_linear_sage_loss(h, w, x.token_ids, x.mask, x.advantages, old_logp=x.old_logp,
                                 ref_logp=x.ref_logp, backend="reference", **{**SETTINGS, "guide": guide})
    out.loss.backward()
    return out.loss.detach(), h.grad, w.grad


def skip_reason(provider, point: Point) -> str | None:
    reason = provider.unavailable(point.device)
    if reason is None and provider.name == "naive":
        need = NAIVE_LOGIT_COPIES * point.n * point.v * 4
        free = available_memory(point.device)
        if need > NAIVE_MEMORY_FRACTION * free:
            reason = (f"needs ~{need / 2**30:.0f} GiB ({NAIVE_LOGIT_COPIES} [N, V] fp32 copies), "
                      f"{free / 2**30:.0f} GiB free")
    return reason


def measure(provider, point: Point, x: Inputs, sliced: Inputs, mode: str, reference, repeats: int,
            budget_s: float) -> dict:
    row = {}
    loss, grad_h, grad_w = run_once(provider, sliced, mode)
    if provider.guide is not None:
        loss64, grad_h64, grad_w64 = reference(provider.guide)
        row = {"err_loss_abs": abs(loss.double().item() - loss64.item()),
               "err_grad_hidden_rel": relative_error(grad_h, grad_h64),
               "err_grad_weight_rel": relative_error(grad_w, grad_w64)}
    leaves = dataclasses.replace(x, hidden=x.hidden.requires_grad_(mode == "fwd+bwd"),
                                 weight=x.weight.requires_grad_(mode == "fwd+bwd"))

    def run():
        if mode == "fwd":
            with torch.no_grad():
                provider.loss(leaves)
        else:
            provider.loss(leaves).backward()

    def reset():
        leaves.hidden.grad = leaves.weight.grad = None

    row.update(time_runs(run, reset, point.device, repeats=repeats, budget_s=budget_s))
    ndv = point.n * point.d * point.v
    seconds = row["ms_p50"] / 1e3
    row["tflops_6ndv"] = (6 if mode == "fwd+bwd" else 2) * ndv / seconds / 1e12
    row["tflops_8ndv"] = (8 if mode == "fwd+bwd" else 2) * ndv / seconds / 1e12
    return row


def run_point(spec: dict, rows_path: str) -> None:
    point = Point(**spec["point"])
    info = machine(point.device)
    x = make_inputs(point, seed=spec.get("seed", 0))
    sliced = error_slice(x)
    references = {}

    def reference(guide):
        if guide not in references:
            references[guide] = float64_result(sliced, guide)
        return references[guide]

    with open(rows_path, "a") as rows:
        for name in spec["providers"]:
            provider = PROVIDERS[name]
            reason = skip_reason(provider, point)
            for mode in spec["modes"]:
                row = {**base_row(point, name, mode), "err_tokens": sliced.token_ids.numel(), **info,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                if reason:
                    row["status"] = f"skipped: {reason}"
                else:
                    try:
                        row.update(measure(provider, point, x, sliced, mode, reference, spec["repeats"],
                                           spec["budget_s"]))
                        row["status"] = "ok"
                    except Exception as error:  # a provider failing is a result to report, not a crash
                        row["status"] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
                rows.write(json.dumps(row) + "\n")
                rows.flush()
                print(describe(row), file=sys.stderr, flush=True)


def base_row(point: Point, provider: str, mode: str) -> dict:
    """The fields that name a row: op, provider, point (shape, N, D, V, dtype, mask, device), mode."""
    return {"op": "sage_loss", "provider": provider, **dataclasses.asdict(point), "d": point.d, "v": point.v,
            "mode": mode}


def describe(row: dict) -> str:
    head = (f"{row['shape']} N={row['n']} {row['dtype']} mask={row['mask_fraction']} {row['mode']:7} "
            f"{row['provider']:22}")
    if row["status"] != "ok":
        return f"{head} {row['status']}"
    return f"{head} {row['ms_p50']:10.1f} ms  {row['peak_mem_mib'] or 0:9.1f} MiB  runs={row['runs']}"


if __name__ == "__main__":
    run_point(json.loads(sys.argv[1]), sys.argv[2])
