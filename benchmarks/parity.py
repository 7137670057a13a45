"""`python -m benchmarks.parity`: the Triton loss against float64 at a whole benchmark point.

The loss benchmark measures errors on a 256-token slice, a single token chunk; here each path
runs fwd+bwd on every token of the point (at N 16k the three-matmul path sums its weight
gradient over ~26 token chunks in the weight's dtype), and a float64 evaluation gives the loss,
the gradient of a sample of weight rows (the most frequent targets, which carry the one-hot
term, and rows spread over the vocabulary) and of a sample of hidden rows (valid tokens spread
over the batch). The float64 side is chunked over tokens, so no [N, V] tensor exists at once:
lse, log p and the entropy per token, then g = dloss/dlogp and c = dloss/dH from the reference's
token stage by autograd, then d(logits) = (g (1[v = y] - p) - c p (log p + H)) / T for the
sampled rows only, times d(logits)/d(head output) (1/T, or the softcap's slope).

Errors as `tests/kernels/tolerances.py` measures them (loss: absolute; gradients:
max |g - g64| / max |g64|), each gradient beside the error of rounding the float64 gradient to
the dtype once, the least any output in that dtype can have, and a verdict against that file's
tolerances for the dtype (read from the checkout; none outside one) with the worst element of
each gradient. Parts: the two paths, and (named, not run by default) the two-pass path under a
logit softcap. Each part runs in a process of its own (`isolated.py`); rows go to
``parity.jsonl`` and ``parity.md`` is rewritten as each ends.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

from . import isolated
from .measure import machine, relative_error
from .profile_stages import PATHS, REPO_ROOT, parse_args
from .shapes import DTYPES, Inputs, Point, make_inputs

F64 = torch.float64
#: sampled weight rows: the most frequent targets, and as many spread over the vocabulary.
TARGET_ROWS = 32
SPREAD_ROWS = 32
#: sampled hidden rows (valid tokens spread over the batch).
HIDDEN_ROWS = 64
#: tokens per float64 logits chunk ([chunk, V] float64 at once: 1.2 GB at V 152k).
CHUNK = 1024
#: the softcap of the softcap part: at the benchmark's logit spread (std 3, top logits ~13) it
#: saturates the top of each row (tanh' ~ 0.02 there), where the backward's slope must stay exact.
SOFTCAP = 5.0
#: part name -> loss options (on top of the benchmark's shared settings, guide off).
PARTS = {**PATHS, "two-pass-softcap": {**PATHS["two-pass"], "logit_softcap": SOFTCAP}}
#: the parts run without --paths.
DEFAULT_PARTS = tuple(PATHS)
TOLERANCES_FILE = REPO_ROOT / "tests" / "kernels" / "tolerances.py"


def tolerance_table() -> dict | None:
    """TOLERANCES of tests/kernels/tolerances.py (their one home), or None outside a checkout."""
    if not TOLERANCES_FILE.exists():
        return None
    spec = importlib.util.spec_from_file_location("sage_test_tolerances", TOLERANCES_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TOLERANCES


def sampled_rows(x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight rows, hidden rows) to check, both sorted index vectors on the inputs' device."""
    ids = x.token_ids.reshape(-1)
    valid = x.mask.reshape(-1).nonzero().squeeze(1)
    V = x.weight.shape[0]
    counts = torch.bincount(ids[valid], minlength=V)
    frequent = counts.argsort(descending=True, stable=True)[:TARGET_ROWS]
    spread = torch.linspace(0, V - 1, SPREAD_ROWS, device=ids.device).long()
    weight_rows = torch.unique(torch.cat([frequent, spread]))
    picks = torch.linspace(0, valid.numel() - 1, min(HIDDEN_ROWS, valid.numel()), device=ids.device).long()
    return weight_rows, torch.unique(valid[picks])


def _head(a, logits):
    """(logits z, dz/da) of the float64 head output `a` under `logits` (a `spec.LogitMap`)."""
    if logits.softcap:
        t = torch.tanh(logits.inner * a)
        return logits.outer * t, logits.inner * logits.outer * (1 - t * t)
    return logits.inner * a, logits.inner


def _d_head(a, rows_ids, cols, lse, entropy, g, c, logits):
    """float64 d(loss)/d(head output) of the [rows, cols] block whose head output is `a`."""
    z, slope = _head(a, logits)
    log_p = z - lse[:, None]
    p = log_p.exp()
    dz = g[:, None] * ((rows_ids[:, None] == cols[None, :]).to(F64) - p) - c[:, None] * p * (log_p + entropy[:, None])
    return dz * slope


def float64_reference(x: Inputs, config, weight_rows: torch.Tensor, hidden_rows: torch.Tensor):
    """(loss, grad of `weight_rows` of the weight, grad of `hidden_rows` of hidden) in float64."""
    from sage_kernels import reference
    from sage_kernels.inputs import validate_inputs

    B, L, D = x.hidden.shape
    h = x.hidden.reshape(-1, D)
    w64 = x.weight.to(F64)
    ids = x.token_ids.reshape(-1)
    N = h.shape[0]
    logits = config.logit_map
    lse, logp, entropy = (torch.empty(N, dtype=F64, device=h.device) for _ in range(3))
    for s in range(0, N, CHUNK):
        z, _ = _head(h[s : s + CHUNK].to(F64) @ w64.t(), logits)
        lse[s : s + CHUNK] = z.logsumexp(-1)
        logp[s : s + CHUNK] = z.gather(1, ids[s : s + CHUNK, None]).squeeze(1) - lse[s : s + CHUNK]
        entropy[s : s + CHUNK] = lse[s : s + CHUNK] - ((z - lse[s : s + CHUNK, None]).exp() * z).sum(-1)
        del z
    logp_leaf = logp.view(B, L).requires_grad_()
    entropy_leaf = entropy.view(B, L).requires_grad_()
    inputs = validate_inputs(
        x.hidden, x.weight, x.token_ids, x.mask, x.advantages, old_logp=x.old_logp, ref_logp=x.ref_logp, config=config
    )
    loss, _ = reference.token_stage(logp_leaf, entropy_leaf, inputs, config)
    g, c = torch.autograd.grad(loss, (logp_leaf, entropy_leaf), allow_unused=True)
    g = g.reshape(-1)
    c = torch.zeros_like(g) if c is None else c.reshape(-1)
    grad_w = torch.zeros(weight_rows.numel(), D, dtype=F64, device=h.device)
    w_rows = w64[weight_rows]
    for s in range(0, N, CHUNK):
        h_chunk = h[s : s + CHUNK].to(F64)
        part = slice(s, s + CHUNK)
        a = h_chunk @ w_rows.t()
        grad_w += _d_head(a, ids[part], weight_rows, lse[part], entropy[part], g[part], c[part], logits).t() @ h_chunk
    r = hidden_rows
    cols = torch.arange(w64.shape[0], device=h.device)
    grad_h = _d_head(h[r].to(F64) @ w64.t(), ids[r], cols, lse[r], entropy[r], g[r], c[r], logits) @ w64
    return loss.detach(), grad_w, grad_h


def check_path(name: str, point: Point) -> dict:
    """One fwd+bwd of path `name` on the whole point, against `float64_reference`."""
    from sage_kernels import LossConfig, fused_linear_sage_loss
    from sage_kernels.triton import three_matmul

    from .providers import SETTINGS

    x = make_inputs(point)
    config = LossConfig(**{**SETTINGS, "guide": "none", **PARTS[name]})
    hidden = x.hidden.detach().requires_grad_()
    weight = x.weight.detach().requires_grad_()
    before = three_matmul.PATHS_TAKEN.copy()
    out = fused_linear_sage_loss(
        hidden,
        weight,
        x.token_ids,
        x.mask,
        x.advantages,
        old_logp=x.old_logp,
        ref_logp=x.ref_logp,
        backend="triton",
        config=config,
    )
    out.loss.backward()
    taken = sorted(three_matmul.PATHS_TAKEN - before)
    weight_rows, hidden_rows = sampled_rows(x)
    loss64, grad_w64, grad_h64 = float64_reference(x, config, weight_rows, hidden_rows)
    dtype = DTYPES[point.dtype]
    grad_w = weight.grad[weight_rows]
    grad_h = hidden.grad.reshape(-1, point.d)[hidden_rows]
    row = {
        "path": name,
        "path_taken": taken,
        "status": "ok",
        "logit_softcap": config.logit_softcap,
        "loss": out.loss.item(),
        "loss64": loss64.item(),
        "err_loss_abs": abs(out.loss.double().item() - loss64.item()),
        "err_grad_weight_rel": relative_error(grad_w, grad_w64),
        "rounding_grad_weight_rel": relative_error(grad_w64.to(dtype), grad_w64),
        "worst_grad_weight": worst_element(grad_w, grad_w64, weight_rows),
        "err_grad_hidden_rel": relative_error(grad_h, grad_h64),
        "rounding_grad_hidden_rel": relative_error(grad_h64.to(dtype), grad_h64),
        "worst_grad_hidden": worst_element(grad_h, grad_h64, hidden_rows),
        "weight_rows": weight_rows.numel(),
        "hidden_rows": hidden_rows.numel(),
        "shape": point.shape,
        "n": point.n,
        "d": point.d,
        "v": point.v,
        "dtype": point.dtype,
        "mask_fraction": point.mask_fraction,
        **machine(point.device),
    }
    return {**row, **verdict(row, dtype)}


def worst_element(actual: torch.Tensor, expected: torch.Tensor, rows: torch.Tensor) -> dict:
    """The element of a sampled gradient farthest from float64: its row in the whole tensor, its
    column, and both values."""
    diff = (actual.double() - expected).abs()
    r, col = divmod(int(diff.argmax()), diff.shape[1])
    return {"row": int(rows[r]), "col": col, "actual": float(actual[r, col]), "expected": float(expected[r, col])}


def verdict(row: dict, dtype: torch.dtype) -> dict:
    """Pass or fail against tests/kernels/tolerances.py's tolerances for `dtype`, measured as it does:
    the loss within atol + rtol |loss64|, each gradient's max-norm relative error within `grad`."""
    table = tolerance_table()
    if table is None:
        return {"verdict": "no verdict: tests/kernels/tolerances.py is not in this checkout"}
    atol, rtol = table[dtype]["loss"]
    grad = table[dtype]["grad"]
    failed = ["loss"] if row["err_loss_abs"] > atol + rtol * abs(row["loss64"]) else []
    failed += [f"d({name})" for name in ("weight", "hidden") if row[f"err_grad_{name}_rel"] > grad]
    return {
        "tolerance_loss": [atol, rtol],
        "tolerance_grad": grad,
        "verdict": f"fail: {', '.join(failed)}" if failed else "pass",
    }


def markdown(point: Point, rows: list[dict], command: str) -> str:
    lines = [
        f"Float64 parity: {point.shape} (D {point.d}, V {point.v}), N {point.n}, {point.dtype}, "
        f"{point.mask_fraction:.0%} masked, fwd+bwd on every token.",
        "",
        f"Command: `{command}`",
        "",
        "| path | ran as | loss | float64 loss | err loss | err d(weight) rows | one rounding | "
        "err d(hidden) rows | one rounding |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['path']} | {r['status']} |" + " — |" * 7)
            continue
        lines.append(
            f"| {r['path']} | {', '.join(r['path_taken'])} | {r['loss']:.6g} | {r['loss64']:.6g} | "
            f"{r['err_loss_abs']:.2e} | {r['err_grad_weight_rel']:.2e} ({r['weight_rows']} rows) | "
            f"{r['rounding_grad_weight_rel']:.2e} | {r['err_grad_hidden_rel']:.2e} ({r['hidden_rows']} rows) | "
            f"{r['rounding_grad_hidden_rel']:.2e} |"
        )
    lines += [
        "",
        "| path | verdict (tests/kernels/tolerances.py) | worst d(weight) element | worst d(hidden) element |",
        "|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] == "ok":
            tolerance = f" (loss {r['tolerance_loss']}, grad {r['tolerance_grad']})" if "tolerance_grad" in r else ""
            worst = (describe_element("W", r["worst_grad_weight"]), describe_element("h", r["worst_grad_hidden"]))
            lines.append(f"| {r['path']} | {r['verdict']}{tolerance} | {worst[0]} | {worst[1]} |")
    return "\n".join(lines) + "\n"


def describe_element(name: str, worst: dict) -> str:
    return f"{name}[{worst['row']}, {worst['col']}]: {worst['actual']:.6g} vs {worst['expected']:.6g}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, prog="python -m benchmarks.parity", doc=__doc__, parts=tuple(PARTS), default=DEFAULT_PARTS)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first imported
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "parity.jsonl"
    point = Point(args.shape, args.n, args.dtype, args.mask, args.device)
    if args.part:
        isolated.append_row(rows_path, check_path(args.paths[0], point))
        return 0
    command = ("python -m benchmarks.parity " + " ".join(argv)).strip()
    rows = isolated.run_parts(
        f"{__package__}.parity",
        argv,
        args.paths,
        rows_path,
        args.part_timeout_s,
        lambda rows: (out / "parity.md").write_text(markdown(point, rows, command)),
    )
    print((out / "parity.md").read_text())
    return 0 if all(r["status"] == "ok" and not r["verdict"].startswith("fail") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
