"""Smoke test of the loss benchmark harness on a tiny shape: rows, reports, errors. No timings checked."""

import json

import pytest
import torch
from sage_bench import loss as bench
from sage_bench import report, worker
from sage_bench.chunked_loss import chunked_grpo_loss
from sage_bench.providers import PROVIDERS as ALL_PROVIDERS
from sage_bench.shapes import Point, make_inputs

from sage_kernels import fused_linear_sage_loss

PROVIDERS = [
    "naive",
    "liger-eager",
    "liger-eager-tf32",
    "trl-full-logits",
    "trl-chunked",
    "sage-verl-kernel",
    "verl-fused-linear",
    "gemm-floor",
    "sage-cpu",
    "sage-triton",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = bench.main(
        [
            "--device",
            "cpu",
            "--shapes",
            "tiny",
            "--n",
            "64",
            "--masks",
            "0.5",
            "--repeats",
            "1",
            "--budget-s",
            "1",
            "--providers",
            ",".join(PROVIDERS),
            "--out",
            str(out),
        ]
    )
    rows = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
    return code, rows, out


def test_every_provider_and_mode_has_a_row(run):
    code, rows, _ = run
    assert code == 0
    assert sorted((r["provider"], r["mode"]) for r in rows) == sorted(
        (p, m) for p in PROVIDERS for m in ("fwd", "fwd+bwd")
    )
    for r in rows:
        assert r["status"] == "ok" or r["status"].startswith("skipped: "), r["status"]
        point = (r["shape"], r["n"], r["d"], r["v"], r["dtype"], r["mask_fraction"])
        assert point == ("tiny", 64, 64, 1000, "fp32", 0.5)
        assert r["torch"] and r["cpu"] and "commit" in r
    assert {r["status"] for r in rows if r["provider"] == "sage-triton"} == {"skipped: needs a CUDA device"}
    # TF32 is a CUDA setting: no CPU row claims it either way, and the TF32 Liger row is not run twice
    assert {r["tf32"] for r in rows} == {None}
    assert {r["status"] for r in rows if r["provider"] == "liger-eager-tf32"} == {
        "skipped: TF32 is a CUDA setting (the liger-eager row is the same run here)"
    }


def test_measured_rows_have_sane_fields_and_small_errors(run):
    _, rows, _ = run
    measured = [r for r in rows if r["status"] == "ok"]
    assert {r["provider"] for r in measured} >= {"naive", "gemm-floor"}
    for r in measured:
        assert 0 < r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"] and r["runs"] >= 1
        assert r["peak_mem_mib"] is None or r["peak_mem_mib"] >= 0
        assert r["tflops_6ndv"] > 0 and r["tflops_8ndv"] >= r["tflops_6ndv"]
        assert r["compiles_in_timing"] == 0
        if r["provider"] == "gemm-floor":  # no loss, so no error to report
            assert "err_loss_abs" not in r
            continue
        assert r["err_loss_abs"] < 1e-5
        if r["mode"] == "fwd+bwd":
            assert r["err_grad_hidden_rel"] < 1e-4 and r["err_grad_weight_rel"] < 1e-4


def test_reports_are_written(run):
    _, _, out = run
    text = (out / "loss.md").read_text()
    assert "| provider | TF32 |" in text and "Machine:" in text and "skipped: needs a CUDA device" in text
    pytest.importorskip("matplotlib")
    assert (out / "loss.png").stat().st_size > 0


def test_chunked_peer_matches_the_float64_reference():
    x = make_inputs(Point("tiny", 2048, "fp32", 0.5, "cpu"))
    h, w = x.hidden.clone().requires_grad_(), x.weight.clone().requires_grad_()
    loss = chunked_grpo_loss(h, w, x.token_ids, x.mask, x.advantages, x.old_logp, x.ref_logp, compiled=False)
    (loss * 3.0).backward()
    h64, w64 = x.hidden.double().requires_grad_(), x.weight.double().requires_grad_()
    ref = fused_linear_sage_loss(
        h64,
        w64,
        x.token_ids,
        x.mask,
        x.advantages,
        old_logp=x.old_logp,
        ref_logp=x.ref_logp,
        backend="reference",
        guide="none",
        beta=0.05,
    )
    (ref.loss * 3.0).backward()
    torch.testing.assert_close(loss.double(), ref.loss.detach(), atol=1e-5, rtol=1e-5)
    for got, want in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-4


def test_targets_table_uses_the_faster_liger_and_names_missing_peers():
    point = {"shape": "cpu-small", "n": 2048, "dtype": "fp32", "mask_fraction": 0.0, "mode": "fwd+bwd"}
    rows = [
        {**point, "provider": name, "status": "ok", "ms_p50": ms, "peak_mem_mib": mib, "extra_mem_mib": mib / 2}
        for name, ms, mib in (("sage-cpu", 90.0, 40.0), ("liger-compiled", 100.0, 100.0), ("liger-eager", 80.0, 70.0))
    ]
    rows.append({**point, "provider": "gemm-floor", "status": "skipped: test"})
    lines = report.targets_table(rows).splitlines()[2:]
    verdicts = [line.split(" | ")[-1] for line in lines]
    assert verdicts == ["not met |", "not met |", "not met |", "not measured (gemm-floor: skipped: test) |"]
    assert "| 1.125 |" in lines[0] and "| 0.571 |" in lines[1]  # against liger-eager, the faster one


def test_cuda_rows_record_tf32_and_run_with_it():
    point = Point("qwen2.5-7b", 16384, "bf16", 0.0, "cuda")
    assert worker.base_row(point, "liger-eager-tf32", "fwd+bwd")["tf32"] is True
    assert worker.base_row(point, "liger-eager", "fwd+bwd")["tf32"] is False
    assert worker.base_row(point, "sage-triton", "fwd+bwd")["tf32"] is False
    before = torch.backends.cuda.matmul.allow_tf32
    for on in (True, False):
        with worker.matmul_tf32(on):
            assert torch.backends.cuda.matmul.allow_tf32 is on
        assert torch.backends.cuda.matmul.allow_tf32 is before


def test_liger_best_includes_the_tf32_row():
    point = {"shape": "qwen2.5-7b", "n": 16384, "dtype": "bf16", "mask_fraction": 0.0, "mode": "fwd+bwd"}
    rows = [
        {**point, "provider": name, "status": "ok", "ms_p50": ms, "peak_mem_mib": 10.0, "extra_mem_mib": 5.0}
        for name, ms in (("sage-triton", 100.0), ("liger-eager", 900.0), ("liger-eager-tf32", 400.0))
    ]
    line = next(line for line in report.targets_table(rows).splitlines() if "liger (best) | time" in line)
    assert "| 0.250 |" in line  # 100 / 400: against the TF32 row, the fastest Liger


def test_the_default_plan_runs_ours_and_the_floor_first_and_stops_starting_rows_in_time():
    order = list(ALL_PROVIDERS)
    peers = [i for i, name in enumerate(order) if not ALL_PROVIDERS[name].ours and name != "gemm-floor"]
    assert order.index("sage-cpu") < order.index("gemm-floor") < min(peers)
    assert order.index("sage-triton") < min(peers)
    cpu = bench.parse_args(["--device", "cpu"])
    assert list(cpu.providers) == order and cpu.time_limit_s == bench.DEFAULT_PLAN_LIMIT_S["cpu"]
    # the last row it starts (a qwen2.5-0.5b peer's, up to a minute) still ends within 10 minutes
    assert cpu.time_limit_s + 60 <= 600
    assert bench.parse_args(["--device", "cpu", "--shapes", "tiny"]).time_limit_s is None  # a chosen plan: no limit
    assert bench.parse_args(["--device", "cpu", "--time-limit-s", "30"]).time_limit_s == 30
    # CPU: ours and the floor at every point before any peer's worker starts
    points = bench.plan(cpu)
    groups = bench.worker_groups(points, cpu.providers, "cpu")
    ours = [name for name in order if ALL_PROVIDERS[name].ours or name == "gemm-floor"]
    assert [names for _, names in groups] == [ours] * len(points) + [[n for n in order if n not in ours]] * len(points)
    assert [group[0] for group, _ in groups] == points * 2
    assert bench.worker_groups(points, ["sage-triton", "naive"], "cuda") == [
        (points, ["sage-triton"]),
        (points, ["naive"]),
    ]
