"""Rows -> a markdown report (the performance targets, ours against each peer, all rows) and a plot against N."""

from __future__ import annotations

from collections import defaultdict

PEERS = ("naive", "torch-compile-chunked", "liger (best)", "liger-compiled", "liger-eager", "gemm-floor")
#: the rows `liger (best)` is the fastest of (TF32 on or off: each row records which)
LIGERS = ("liger-compiled", "liger-eager", "liger-eager-tf32")

#: The performance targets, all fwd+bwd with nothing masked: (shape, N, dtype, ours, peer, measure,
#: bound on ours / peer). The CPU backend's memory bound against Liger is shown both with the
#: gradients (peak memory above the inputs) and without them (extra memory).
TARGETS = tuple(
    [
        (shape, n, "fp32", "sage-cpu", peer, measure, bound)
        for shape, n in (("cpu-small", 2048), ("qwen2.5-0.5b", 4096))
        for peer, measure, bound in (
            ("liger (best)", "time", 1.0),
            ("liger (best)", "peak memory", 0.5),
            ("liger (best)", "extra memory", 0.5),
            ("gemm-floor", "time", 1.3),
        )
    ]
    + [
        ("qwen2.5-7b", 16384, "bf16", "sage-triton", peer, measure, bound)
        for peer, measure, bound in (
            ("gemm-floor", "time", 1.3),
            ("liger (best)", "time", 0.5),
            ("naive", "extra memory", 0.01),
        )
    ]
)
MEASURES = {"time": "ms_p50", "peak memory": "peak_mem_mib", "extra memory": "extra_mem_mib"}


def _point_key(row: dict) -> tuple:
    return row["shape"], row["n"], row["dtype"], row["mask_fraction"], row["mode"]


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def machine_line(rows: list[dict]) -> str:
    row = rows[0]
    gpu = row.get("gpu") or "no GPU"
    return (
        f"{row['cpu']}, {row['cores']} cores ({row['threads']} torch threads), {gpu}; "
        f"torch {row['torch']}, triton {row.get('triton')}, liger-kernel {row.get('liger_kernel')}, "
        f"Python {row['python']}; "
        f"commit {row['commit']}"
    )


def _runs(row: dict) -> str:
    """Timed runs, flagged when torch.compile compiled during them (their time is then suspect)."""
    compiles = row.get("compiles_in_timing")
    return f"{row.get('runs', '—')}" + (f" ({compiles} compiles!)" if compiles else "")


def results_table(rows: list[dict]) -> str:
    lines = [
        "| shape | N | D | V | dtype | masked | mode | provider | TF32 | p50 ms | p20–p80 ms | runs "
        "| peak MiB | extra MiB | TFLOP/s (6NDV) | TFLOP/s (8NDV) | err loss | err d(hidden) "
        "| err d(weight) | status |",
        "|" + "---|" * 20,
    ]
    for r in rows:
        ok = r["status"] == "ok"
        spread = f"{r['ms_p20']:.1f}–{r['ms_p80']:.1f}" if ok else "—"
        tf32 = {True: "on", False: "off"}.get(r.get("tf32"), "—")  # None: CPU, where it does nothing
        lines.append(
            f"| {r['shape']} | {r['n']} | {r['d']} | {r['v']} | {r['dtype']} | {r['mask_fraction']:.0%} "
            f"| {r['mode']} | {r['provider']} | {tf32} | {_fmt(r.get('ms_p50'), '.1f')} | {spread} "
            f"| {_runs(r)} "
            f"| {_fmt(r.get('peak_mem_mib'), '.0f')} | {_fmt(r.get('extra_mem_mib'), '.0f')} "
            f"| {_fmt(r.get('tflops_6ndv'), '.3f')} "
            f"| {_fmt(r.get('tflops_8ndv'), '.3f')} | {_fmt(r.get('err_loss_abs'), '.1e')} "
            f"| {_fmt(r.get('err_grad_hidden_rel'), '.1e')} | {_fmt(r.get('err_grad_weight_rel'), '.1e')} "
            f"| {r['status']} |"
        )
    return "\n".join(lines)


def _by_point(rows: list[dict]) -> dict:
    points = defaultdict(dict)
    for r in rows:
        if r["status"] == "ok":
            points[_point_key(r)][r["provider"]] = r
    for measured in points.values():
        ligers = [measured[n] for n in LIGERS if n in measured]
        if ligers:
            measured["liger (best)"] = min(ligers, key=lambda r: r["ms_p50"])
    return points


def _ratio(ours: dict, peer: dict | None) -> str:
    if peer is None:
        return "—"
    time = ours["ms_p50"] / peer["ms_p50"]
    mine, theirs = ours.get("peak_mem_mib"), peer.get("peak_mem_mib")
    memory = f"{mine / theirs:.2f}×" if mine is not None and theirs else "—"
    return f"{time:.2f}× · {memory}"


def ratio_table(rows: list[dict], ours_names: list[str]) -> str:
    """Time and memory of each of our guide-off providers divided by each peer's, per point."""
    lines = [
        "| shape | N | dtype | masked | mode | ours | " + " | ".join(PEERS) + " | branch guide / off |",
        "|" + "---|" * (len(PEERS) + 7),
    ]
    for (shape, n, dtype, mask, mode), measured in _by_point(rows).items():
        for name in ours_names:
            if name not in measured:
                continue
            ours = measured[name]
            cells = [_ratio(ours, measured.get(peer)) for peer in PEERS]
            cells.append(_ratio(measured[f"{name}-branch"], ours) if f"{name}-branch" in measured else "—")
            head = f"| {shape} | {n} | {dtype} | {mask:.0%} | {mode} | {name} | "
            lines.append(head + " | ".join(cells) + " |")
    return "\n".join(lines)


def target_verdicts(rows: list[dict], targets=TARGETS) -> list[dict]:
    """`targets` (as `TARGETS`) at the points this run measured: ours and the peer's value, their
    ratio (None when either is missing) and the verdict ("met", "not met", "not measured (why)")."""
    points = _by_point(rows)
    status = {(_point_key(r), r["provider"]): r["status"] for r in rows}
    verdicts = []
    for shape, n, dtype, ours, peer, measure, bound in targets:
        key = (shape, n, dtype, 0.0, "fwd+bwd")
        if not any(k == key for k, _ in status):
            continue
        measured = points.get(key, {})
        field = MEASURES[measure]
        mine, theirs = measured.get(ours, {}).get(field), measured.get(peer, {}).get(field)
        ratio = None if mine is None or not theirs else mine / theirs
        if ratio is None:
            missing = ours if mine is None else peer
            names = LIGERS if missing == "liger (best)" else (missing,)
            why = "; ".join(f"{name}: {status.get((key, name), 'not in this run')}" for name in names)
            verdict = f"not measured ({why})"
        else:
            verdict = "met" if ratio <= bound else "not met"
        verdicts.append(
            dict(shape=shape, n=n, dtype=dtype, ours=ours, peer=peer, measure=measure, mine=mine, theirs=theirs)
            | dict(ratio=ratio, bound=bound, verdict=verdict)
        )
    return verdicts


def targets_table(rows: list[dict]) -> str:
    """The targets at the points this run measured: ours / peer against the bound."""
    lines = ["| shape | N | dtype | ours / peer | measure | ratio | bound | verdict |", "|" + "---|" * 8]
    for t in target_verdicts(rows):
        ratio = "—" if t["ratio"] is None else f"{t['ratio']:.3f}"
        lines.append(
            f"| {t['shape']} | {t['n']} | {t['dtype']} | {t['ours']} / {t['peer']} | {t['measure']} | {ratio} "
            f"| ≤ {t['bound']} | {t['verdict']} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def markdown(rows: list[dict], command: str, ours_names: list[str]) -> str:
    targets = targets_table(rows)
    return "\n".join(
        [
            f"Machine: {machine_line(rows)}.",
            "",
            f"Command: `{command}`",
            "",
            *(
                ["Targets (fwd+bwd, nothing masked; `extra memory` excludes the gradients):", "", targets, ""]
                if targets
                else []
            ),
            "Ratios are ours / peer, time (p50) · peak memory above the inputs; below 1 means ours is faster or "
            "lighter. `liger (best)` is the fastest of liger-compiled, liger-eager and liger-eager-tf32 "
            "(CUDA: TF32 on) at that point.",
            "",
            ratio_table(rows, ours_names),
            "",
            results_table(rows),
            "",
        ]
    )


def plot(rows: list[dict], path: str) -> str | None:
    """Time and peak memory against N, one row of panels per (shape, dtype, mask, mode)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; no plot (pip install 'sage-rl[bench]')"
    groups = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["status"] == "ok":
            groups[(r["shape"], r["dtype"], r["mask_fraction"], r["mode"])][r["provider"]].append(r)
    if not groups:
        return "no measured rows; no plot"
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 3.2 * len(groups)), squeeze=False)
    for (shape, dtype, mask, mode), (ax_time, ax_mem) in zip(groups, axes):
        for provider, measured in groups[(shape, dtype, mask, mode)].items():
            measured.sort(key=lambda r: r["n"])
            ns = [r["n"] for r in measured]
            ax_time.plot(ns, [r["ms_p50"] for r in measured], marker="o", label=provider)
            ax_mem.plot(ns, [r["peak_mem_mib"] or float("nan") for r in measured], marker="o", label=provider)
        title = f"{shape} {dtype} {mode}, {mask:.0%} masked"
        for ax, label in ((ax_time, "time p50 (ms)"), (ax_mem, "peak memory above inputs (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("N (tokens)")
            ax.set_ylabel(label)
            ax.set_title(title, fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
        ax_time.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
