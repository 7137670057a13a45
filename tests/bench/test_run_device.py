"""benchmarks/run_device.sh end to end on CPU with a small plan (the interpreter, the tiny shape, one kernel
test a pytest call, three providers): every part runs under its budget, the results come back in three
files, the verdicts are stated, and the device plan fits one 600 s call with time left to pack; cut short
by SIGTERM it packs what was written. Also the `device` hypothesis profile's cap and the summary's parsers."""

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from benchmarks import device_summary, parity, profile_stages

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "run_device.sh"
TEST = "tests/kernels/triton_backend/test_triton_ops.py::test_boundary_records_round_trip_their_flat_form"
VARIANT_TEST = "tests/kernels/test_off_policy_mask.py::test_a_bad_threshold_raises"
PACKED_TEST = "tests/kernels/test_dppo.py::test_dppo_options_that_do_not_apply_raise"
#: the device tool's limit on one call, in seconds, and the wall time the whole run must fit (packed):
#: 9 minutes, which leaves a cold start and a retry's start inside the lease's 15 minutes
CALL_LIMIT_S = 600
RUN_LIMIT_S = 540
#: the parts, in the order the script runs them: correctness on the device, the benchmark, the profile
PARTS = (
    "environment",
    "kernel tests",
    "variant tests",
    "packed tests",
    "float64 parity",
    "benchmark",
    "stage profile",
)


def probe_wheel(folder: Path) -> Path:
    """A real (if tiny) wheel, for the environment part to install offline."""
    folder.mkdir()
    path = folder / "sage_probe-0.1-py3-none-any.whl"
    info = "sage_probe-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("sage_probe/__init__.py", "VALUE = 1\n")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: sage-probe\nVersion: 0.1\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return folder


def small_plan(tmp_path: Path, **changes) -> dict:
    return {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable,
        "WHEELS": str(probe_wheel(tmp_path / "wheels")),
        "SAGE_DEVICE": "cpu",
        "SAGE_SHAPE": "tiny",
        "SAGE_N": "64",
        "SAGE_DTYPE": "fp32",
        "SAGE_REPEATS": "1",
        "SAGE_TESTS": TEST,
        "SAGE_VARIANT_TESTS": VARIANT_TEST,
        "SAGE_PACKED_TESTS": PACKED_TEST,
        "SAGE_PROVIDERS": "sage-triton,gemm-floor,naive",
        "SAGE_BUDGET_SCALE": "4",  # the interpreter on a shared 2-core machine
        **changes,
    }


def packed(out: Path) -> dict[str, str]:
    """name -> text of each file in results.tar.gz (an image: its size)."""
    with tarfile.open(out / "results.tar.gz") as tar:
        files = {Path(m.name).name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    return {name: f"{len(data)} bytes" if name.endswith(".png") else data.decode() for name, data in files.items()}


def rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.slow
def test_run_device_with_a_small_plan(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT)], env=small_plan(tmp_path), capture_output=True, text=True)
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["results.tar.gz", "run.log", "summary.txt"]  # at most 8 return
    assert summary in proc.stdout  # the tool's output tail shows it
    plan, stop = map(int, re.search(r"^plan: (\d+) s of part budgets, stopping by (\d+) s", summary, re.M).groups())
    assert plan < stop <= RUN_LIMIT_S < CALL_LIMIT_S  # the device plan at scale 1, its last pack included
    for name in PARTS:
        assert re.search(rf"^{name}: exit 0, \d+ s \(budget \d+ s\)", summary, re.M), summary
    assert [line.split(":")[0] for line in summary.splitlines() if line.split(":")[0] in PARTS] == list(PARTS)
    assert re.search(r"^kernel tests: exit 0.*: 1 passed", summary, re.M)
    log = (out / "run.log").read_text()
    assert f"{TEST} PASSED" in log  # -v: one line per test, streamed
    assert "sage-triton: skipped: needs a CUDA device (no worker started)" in log
    files = packed(out)
    assert set(files) == {
        *("gpu.txt", "kernel-tests.log", "variant-tests.log", "packed-tests.log", "stages.md", "stages.jsonl"),
        "parity.md",
        *("parity.jsonl", "loss.md", "loss.jsonl", "loss.png"),
    }
    assert "from wheels: sage_probe-0.1" in files["gpu.txt"]
    assert f"{TEST} PASSED" in files["kernel-tests.log"] and "passed" in files["variant-tests.log"]
    stages = {r["path"]: r for r in rows(files["stages.jsonl"])}
    assert list(stages) == ["three-matmul", "gemm-floor", "three-matmul-unsplit", "two-pass"]
    assert all(r["status"] == "ok" for r in stages.values())
    assert stages["three-matmul-unsplit"]["dh_slices"] == 1
    assert stages["three-matmul-unsplit"]["path_taken"] == ["three-matmul"]
    checks = {r["path"]: r for r in rows(files["parity.jsonl"])}
    assert list(checks) == ["three-matmul", "two-pass", "two-pass-softcap"]
    assert [r["verdict"] for r in checks.values()] == ["pass"] * 3
    assert checks["two-pass-softcap"]["logit_softcap"] == parity.SOFTCAP
    statuses = {r["provider"]: r["status"] for r in rows(files["loss.jsonl"])}
    assert statuses == {"sage-triton": "skipped: needs a CUDA device", "gemm-floor": "ok", "naive": "ok"}
    # the verdicts, from what the parts wrote
    verdicts = summary.split("verdicts:\n", 1)[1]
    floor_ms = stages["gemm-floor"]["ms_total"]
    ratio = stages["three-matmul"]["ms_total"] / floor_ms
    assert re.search(
        rf"stage profile: three-matmul: [\d.]+ ms / GEMM floor {floor_ms:.1f} ms = {ratio:.2f}, token chunk \d+ rows"
        r", extra \d+ MiB \(target <= 1.3: (not met|met; goal 1.2: (met|not met))\)",
        verdicts,
    ), verdicts
    assert re.search(r"d\(hidden\) split: 1 vocabulary slices [\d.]+ ms vs one product [\d.]+ ms", verdicts)
    assert (
        "benchmark tiny N 64 fp32: sage-triton / gemm-floor time: not measured (sage-triton: skipped: needs a CUDA "
        "device)" in verdicts
    )
    assert "benchmark tiny N 64 fp32: sage-triton / naive extra memory: not measured" in verdicts
    for name, ran_as in (("three-matmul", "three-matmul"), ("two-pass", "two-pass"), ("two-pass-softcap", "two-pass")):
        assert re.search(
            rf"float64 parity: {name} \(ran as {ran_as}\): pass; loss error \S+ \(tolerance 1e-05 \+ 1e-05 \|loss\|\); "
            r"d\(weight\) error \S+ \(tolerance 0.0001\), worst W\[\d+, \d+\]",
            verdicts,
        ), verdicts
    assert "kernel-tests: tests/kernels/triton_backend/test_triton_ops.py: 1 passed" in verdicts
    assert re.search(r"variant-tests: tests/kernels/test_off_policy_mask.py: \d+ passed", verdicts)
    assert re.search(r"packed-tests: tests/kernels/test_dppo.py: \d+ passed", verdicts)


@pytest.mark.slow
def test_run_device_cut_short_packs_what_was_written(tmp_path):
    # SIGTERM (an outer timeout) while the kernel tests run, after their first test passed: the trap
    # stops the part, packs, and states the verdicts of what ran
    out = tmp_path / "out"
    slow = "tests/kernels/triton_backend/test_triton_loss.py::test_every_option_matches_the_reference_fp32"
    env = small_plan(tmp_path, SAGE_TESTS=f"{TEST}\n{slow}")
    proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while f"{TEST} PASSED" not in ((out / "run.log").read_text() if (out / "run.log").exists() else ""):
        assert proc.poll() is None and time.time() < deadline, "the first kernel test never passed"
        time.sleep(0.5)
    begin = time.time()
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143 and time.time() - begin < 30, output
    assert sorted(p.name for p in out.iterdir()) == ["results.tar.gz", "run.log", "summary.txt"]
    summary = (out / "summary.txt").read_text()
    assert re.search(r"^environment: exit 0", summary, re.M) and re.search(
        r"^cut short by SIGTERM at \d+ s, during kernel tests$", summary, re.M
    )
    assert "stage profile" not in summary  # never started
    assert "kernel-tests: tests/kernels/triton_backend/test_triton_ops.py: 1 passed" in summary
    files = packed(out)
    assert "gpu.txt" in files and f"{TEST} PASSED" in files["kernel-tests.log"]
    assert f"{slow} PASSED" not in files["kernel-tests.log"]  # stopped while it ran


def test_the_device_plan_fits_nine_minutes_in_its_order(tmp_path):
    # budgets scaled to zero: no part starts, and the summary states the plan at scale 1 and each part
    # in the order the script would run it (the device's default tests and providers, as on the GPU)
    env = {k: v for k, v in small_plan(tmp_path, SAGE_BUDGET_SCALE="0").items() if not k.startswith("SAGE_")}
    env["SAGE_BUDGET_SCALE"] = "0"
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert proc.returncode == 1, summary
    plan, stop = map(int, re.search(r"^plan: (\d+) s of part budgets, stopping by (\d+) s", summary, re.M).groups())
    assert plan < stop <= RUN_LIMIT_S
    started = [line.split(":")[0] for line in summary.splitlines() if ": not started" in line]
    assert started == list(PARTS)
    script = SCRIPT.read_text()
    # the packed and DPPO Triton tests, and ours and the floor first among the providers, Liger with TF32 on
    assert "tests/kernels/test_packed.py\ntests/kernels/test_dppo.py\n-k\ntriton" in script
    providers = re.search(r'PROVIDERS="\$\{SAGE_PROVIDERS:-([^}]+)\}"', script).group(1).split(",")
    assert providers[:2] == ["sage-triton", "gemm-floor"] and "liger-eager-tf32" in providers
    assert 'pytest_call variant VARIANT_TESTS 8"' in script and 'pytest_call packed PACKED_TESTS 8"' in script


def test_the_memory_verdict_without_naive_bounds_ours_by_one_logits_tensor():
    point = {"shape": "qwen2.5-7b", "n": 16384, "d": 3584, "v": 152064, "dtype": "bf16", "mask_fraction": 0.0}
    point["mode"] = "fwd+bwd"
    logits_mib = 16384 * 152064 * 4 / 2**20
    for extra, verdict in ((0.004 * logits_mib, "met"), (0.04 * logits_mib, "not shown by this bound")):
        rows = [
            {**point, "provider": "sage-triton", "status": "ok", "ms_p50": 100.0, "extra_mem_mib": extra},
            {**point, "provider": "naive", "status": "skipped: needs ~56 GiB"},
        ]
        line = next(line for line in device_summary.benchmark_lines(rows) if "naive extra memory" in line)
        share = extra / logits_mib
        assert "not measured (naive: skipped: needs ~56 GiB)" in line
        assert f"ours {extra:.1f} MiB / N·V·4 {logits_mib:.1f} MiB (one fp32 logits tensor) = {share:.2%}" in line
        assert verdict in line
        if verdict == "met":
            assert f"so ours / naive <= {share:.2%} (target <= 1%: met)" in line


def test_the_summary_counts_both_pytest_progress_formats():
    log = "\n".join(
        [
            "tests/kernels/test_a.py::test_x PASSED                                   [ 20%]",
            "tests/kernels/test_a.py::test_y[{'eps': 0.1}-cpu] FAILED                 [ 40%]",
            "[gw1] [ 60%] PASSED tests/kernels/test_b.py::test_z[bf16]",
            "[gw0] [ 80%] SKIPPED tests/kernels/test_b.py::test_w ",
            "tests/kernels/test_a.py::test_v ERROR                                    [100%]",
            "FAILED tests/kernels/test_a.py::test_y[{'eps': 0.1}-cpu] - AssertionError",  # -ra: not counted again
            "SKIPPED [1] tests/kernels/test_b.py:12: no CUDA",
        ]
    )
    counts = device_summary.outcome_counts(log)
    assert list(counts) == ["tests/kernels/test_a.py", "tests/kernels/test_b.py"]
    assert counts["tests/kernels/test_a.py"] == {"passed": 1, "failed": 1, "error": 1}
    assert counts["tests/kernels/test_b.py"] == {"passed": 1, "skipped": 1}


def test_the_summary_names_the_profile_parts_as_profile_stages_does():
    assert device_summary.DEFAULT_PATH == next(iter(profile_stages.PATHS))
    assert device_summary.FLOOR == profile_stages.FLOOR
    assert profile_stages.TALL.startswith(device_summary.TALL_PREFIX)


def test_the_device_hypothesis_profile_caps_a_tests_own_examples():
    # the test asks for 80 examples in its own @settings; the device profile runs 3
    test = "tests/kernels/test_reference.py::test_reference_matches_independent_trl_style_float64"
    env = {**os.environ, "HYPOTHESIS_PROFILE": "device"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    proc = subprocess.run(
        [*command, "--hypothesis-show-statistics", test], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "Stopped because settings.max_examples=3" in proc.stdout and "3 passing" in proc.stdout
