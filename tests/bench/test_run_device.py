"""benchmarks/run_device.sh end to end on CPU with a fake small plan (the interpreter, the tiny shape, one
kernel test, three providers): every part runs under its budget, the results come back in three files,
the kernel test lines are streamed to the log, and the device plan fits its 420 s by its own budgets."""

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEST = "tests/kernels/test_triton_ops.py::test_boundary_records_round_trip_their_flat_form"


@pytest.mark.slow
def test_run_device_with_a_small_plan(tmp_path):
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHON": sys.executable,
        "WHEELS": str(tmp_path / "no-wheels"),
        "SAGE_DEVICE": "cpu",
        "SAGE_SHAPE": "tiny",
        "SAGE_N": "64",
        "SAGE_DTYPE": "fp32",
        "SAGE_REPEATS": "1",
        "SAGE_TESTS": TEST,
        "SAGE_PROVIDERS": "sage-triton,gemm-floor,naive",
        "SAGE_BUDGET_SCALE": "4",  # the interpreter on a shared 2-core machine
    }
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "run_device.sh")], env=env, capture_output=True, text=True)
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stdout[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["results.tar.gz", "run.log", "summary.txt"]  # at most 6 come back
    plan = int(re.search(r"^plan: (\d+) s of part budgets", summary, re.M).group(1))
    assert plan <= 420  # the device plan at scale 1, so that a second run fits the lease
    for name in ("environment", "kernel tests", "stage profile", "float64 parity", "benchmark"):
        assert re.search(rf"^{name}: exit 0, \d+ s \(budget \d+ s\)", summary, re.M), summary
    assert "kernel tests: exit 0" in summary and "1 passed" in summary
    log = (out / "run.log").read_text()
    assert f"{TEST} PASSED" in log  # -v: one line per test, streamed
    with tarfile.open(out / "results.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
        assert {"gpu.txt", "stages.md", "stages.jsonl", "parity.md", "parity.jsonl", "loss.md", "loss.jsonl"} <= names
        rows = {}
        for kind in ("stages", "parity", "loss"):
            member = next(m for m in tar.getmembers() if Path(m.name).name == f"{kind}.jsonl")
            rows[kind] = [json.loads(line) for line in tar.extractfile(member).read().decode().splitlines()]
    assert [(r["path"], r["status"]) for r in rows["stages"]] == [
        ("three-matmul", "ok"),
        ("two-pass", "ok"),
        ("gemm-floor", "ok"),
    ]
    assert [(r["path"], r["status"]) for r in rows["parity"]] == [("three-matmul", "ok"), ("two-pass", "ok")]
    statuses = {r["provider"]: r["status"] for r in rows["loss"]}
    assert statuses == {"sage-triton": "skipped: needs a CUDA device", "gemm-floor": "ok", "naive": "ok"}
