"""Building and choosing the CPU backend's operator: it builds here, a failed build falls back
with one warning, a killed build's lock is taken over, another process's build is waited on for a
bounded time, and the environment switch and the block sizing do what they say.

The lock tests build a one-line source (seconds, not the operator's minute) and run the waiting side
in a subprocess under a timeout: before the lock of `native_build`, they hung forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import sage_kernels
from sage_kernels import LossConfig, cpu, fused_linear_sage_loss, native_build


def test_native_operator_builds_and_is_registered():
    ops = cpu.native_ops()
    assert ops is not None, "the csrc operator must build on this machine (gcc and ninja are installed)"
    assert hasattr(ops, "block_stats") and hasattr(ops, "block_grad")


def test_the_build_is_cached_under_a_digest_of_its_source(tmp_path):
    # torch caches one build folder per name for every checkout on the machine: with a fixed name, a
    # checkout with another csrc/ rebuilt that folder and this one then loaded the other's operator
    first, moved, edited = tmp_path / "a.cpp", tmp_path / "elsewhere.cpp", tmp_path / "b.cpp"
    first.write_text("int f() { return 1; }\n")
    moved.write_text("int f() { return 1; }\n")
    edited.write_text("int f() { return 2; }\n")
    assert native_build.extension_name(first, "AVX2") == native_build.extension_name(moved, "AVX2")
    assert native_build.extension_name(first, "AVX2") != native_build.extension_name(edited, "AVX2")
    assert native_build.extension_name(first, "AVX2") != native_build.extension_name(first, "AVX512")

    assert cpu.native_ops() is not None
    name = native_build.extension_name(cpu._SOURCE, torch.backends.cpu.get_cpu_capability())
    assert (native_build.build_directory(name) / f"{name}.so").is_file()


def test_the_build_folder_is_namespaced_by_the_versions(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = native_build.build_directory("sage_cpu_avx2_0123456789ab")
    assert folder.parent.parent == tmp_path and folder.name == "sage_cpu_avx2_0123456789ab"
    assert folder.parent.name.startswith(f"sage_kernels-{sage_kernels.__version__}-torch{torch.__version__}-py")


def test_failed_build_warns_once_and_reports_the_compiler_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))  # keep the real cache untouched
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native_build.build_extension(source, "sage_cpu_broken_for_test", []) is False
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert "chunked PyTorch path" in messages[0] and "error" in messages[0].lower()
    # the compiler's own diagnostic, at its file and line, not the command line before it
    assert "Error building extension 'sage_cpu_broken_for_test': " in messages[0]
    assert "broken.cpp:1:" in messages[0] and " -MMD " not in messages[0], messages[0]


def test_a_missing_compiler_is_named_in_the_warning(tmp_path, monkeypatch):
    """The cause ("c++: not found") comes after torch's command line, which the warning once cut it at."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native_build.build_extension(_tiny_source(tmp_path), "sage_cpu_no_compiler_for_test", []) is False
    (message,) = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert f"{tmp_path / 'no-such-compiler'}: not found" in message, message
    assert " -MMD " not in message and "\n" not in message


def test_ninja_beside_the_interpreter_is_found_without_an_activated_venv(tmp_path):
    """`python` of a venv run by path leaves the venv's bin/ (where the ninja dependency puts its program)
    off PATH: torch then said "pip install ninja" although it was installed."""
    import sysconfig

    if not (Path(sysconfig.get_path("scripts")) / "ninja").is_file():
        pytest.skip("no ninja program in this interpreter's scripts folder")
    tools = tmp_path / "bin"  # a compiler and binutils, no ninja
    tools.mkdir()
    for tool in ("c++", "as", "ld"):
        (tools / tool).symlink_to(subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip())
    env = {**_env(tmp_path, 60), "PATH": str(tools)}
    done = subprocess.run(
        [sys.executable, "-c", _BUILDER, str(_tiny_source(tmp_path)), "sage_cpu_ninja_path_for_test"],
        cwd=_REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip() == "built", done.stderr


def test_missing_source_warns_once(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native_build.build_extension(tmp_path / "absent.cpp", "sage_cpu_absent_for_test", []) is False
    assert [str(w.message).count("not found") for w in caught] == [1]


_REPO = Path(__file__).resolve().parents[2]
# holds the build lock of the extension argv[1] as a build does (torch's own lock file too) until a
# line arrives on stdin, then releases both
_HOLDER = """
import sys
from sage_kernels import native_build
lock = native_build.BuildLock(native_build.build_directory(sys.argv[1]))
assert lock.acquire(60)
(lock.path.parent / "lock").touch()
print("held", flush=True)
sys.stdin.readline()
(lock.path.parent / "lock").unlink()
lock.release()
"""
_BUILDER = """
import sys, warnings
from pathlib import Path
from sage_kernels import native_build
warnings.simplefilter("always")
print("built" if native_build.build_extension(Path(sys.argv[1]), sys.argv[2], []) else "fell back")
"""


def _env(tmp_path, wait_s) -> dict:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), native_build.BUILD_WAIT_ENV: str(wait_s)}


def _hold(tmp_path, name) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, name],
        cwd=_REPO,
        env=_env(tmp_path, 60),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def _build(tmp_path, source, name, wait_s) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _BUILDER, str(source), name],
        cwd=_REPO,
        env=_env(tmp_path, wait_s),
        capture_output=True,
        text=True,
        timeout=120,  # a regression hangs here
    )


def _tiny_source(tmp_path) -> Path:
    source = tmp_path / "tiny.cpp"
    source.write_text("int sage_build_lock_test() { return 1; }\n")
    return source


@pytest.mark.parametrize("left_by", ["a killed build", "a file alone"])
def test_a_stale_lock_is_taken_over_and_the_build_proceeds(tmp_path, monkeypatch, left_by):
    # the hang of issue 27: a build killed midway left torch's lock file, and every later first use
    # waited on it forever
    name = "sage_build_stale_test"
    folder = Path(_env(tmp_path, 0)["TORCH_EXTENSIONS_DIR"])
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(folder))
    if left_by == "a killed build":
        holder = _hold(tmp_path, name)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    else:
        native_build.build_directory(name).mkdir(parents=True)
        (native_build.build_directory(name) / "lock").touch()
        (native_build.build_directory(name) / f"{name}.so").write_text("cut short by the kill")
    torch_lock = next(folder.glob(f"*/{name}/lock"))
    result = _build(tmp_path, _tiny_source(tmp_path), name, wait_s=2)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["built"]
    who = "held by pid " if left_by == "a killed build" else f"its outputs left without {native_build.DONE_FILE}"
    assert f"took over from an interrupted build of the native CPU operator ({who}" in result.stderr
    # torch's lock file was removed first (torch 2.13 waits on it forever; 2.14 leaves a new one behind)
    assert (torch_lock.parent / f"{name}.so").is_file() and (torch_lock.parent / native_build.DONE_FILE).is_file()
    assert (torch_lock.parent / native_build.LOCK_FILE).read_text() == ""  # released


def test_a_finished_build_loads_in_a_later_process_though_torchs_lock_file_stays(tmp_path):
    """torch 2.14 leaves its ``lock`` file behind after every build: read as a killed build's, it made
    every new process delete the library and build it again, with a false "interrupted" warning."""
    name, source = "sage_build_finished_test", _tiny_source(tmp_path)
    first = _build(tmp_path, source, name, wait_s=2)
    assert first.stdout.split() == ["built"] and "building the native CPU operator" in first.stderr
    folder = next((tmp_path / "ext").glob(f"*/{name}"))
    (folder / "lock").touch()  # as torch 2.14 leaves it (torch 2.13 deletes it)
    library = folder / f"{name}.so"
    built_at = library.stat().st_mtime_ns
    again = _build(tmp_path, source, name, wait_s=2)
    assert again.returncode == 0 and again.stdout.split() == ["built"], again.stderr[-2000:]
    assert "Warning" not in again.stderr, again.stderr  # neither "interrupted" nor "building"
    assert library.stat().st_mtime_ns == built_at

    source.write_text("int sage_build_lock_test() { return 2; }\n")  # same name, other source: a stale record
    edited = _build(tmp_path, source, name, wait_s=2)
    assert edited.stdout.split() == ["built"], edited.stderr[-2000:]
    assert f"its outputs left without {native_build.DONE_FILE}" in edited.stderr
    assert (folder / native_build.DONE_FILE).read_text() == native_build.build_record(source, name, [])


def test_processes_started_together_build_once(tmp_path):
    """Two torchrun ranks start at once: one builds, the other waits on its lock and loads its build."""
    name, source = "sage_build_together_test", _tiny_source(tmp_path)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILDER, str(source), name],
            cwd=_REPO,
            env=_env(tmp_path, 100),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [rank.communicate(timeout=120) for rank in ranks]
    assert [out.split() for out, _ in results] == [["built"]] * 2, [err[-2000:] for _, err in results]
    errors = "".join(err for _, err in results)
    assert errors.count("building the native CPU operator") == 1, errors
    assert "interrupted build" not in errors and "unavailable" not in errors


def test_the_operator_loads_from_its_cache_in_a_later_process_quickly_and_quietly():
    """The Done-when of issue 47: on torch 2.13 and 2.14, a second process loads the cached operator in
    under 2 s with no warning (torch 2.14 rebuilt it in every process, 13-15 s each)."""
    assert cpu.native_ops() is not None  # built (or loaded) here, in the real cache
    program = """
import time, warnings
warnings.simplefilter("error")  # any warning, "interrupted" or "building", fails the run
from sage_kernels import cpu
start = time.perf_counter()
assert cpu.native_ops() is not None
print(time.perf_counter() - start)
"""
    done = subprocess.run([sys.executable, "-c", program], cwd=_REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout) < 2.0
    assert done.stderr == ""  # nor torch's log lines ("No CUDA runtime is found" from its extension loader)


def test_the_default_build_root_is_torchs():
    from torch.utils.cpp_extension import get_default_build_root

    assert native_build.default_build_root() == get_default_build_root()


def test_a_live_build_is_waited_on_then_the_build_proceeds(tmp_path):
    name = "sage_build_wait_test"
    holder = _hold(tmp_path, name)
    builder = subprocess.Popen(
        [sys.executable, "-c", _BUILDER, str(_tiny_source(tmp_path)), name],
        cwd=_REPO,
        env=_env(tmp_path, 100),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(120, builder.kill)  # a regression hangs on the lock
    watchdog.start()
    try:
        waiting = next((line for line in builder.stderr if "waiting up to" in line), "")  # before any wait
        holder.communicate("done\n", timeout=30)
        out, err = builder.communicate(timeout=120)
    finally:
        watchdog.cancel()
    assert "waiting up to 100 s for another build" in waiting and native_build.LOCK_FILE in waiting
    assert f"pid {holder.pid} on" in waiting and native_build.BUILD_WAIT_ENV in waiting
    assert builder.returncode == 0, err[-2000:]
    assert out.split() == ["built"] and "interrupted build" not in err and "unavailable" not in err


def test_a_build_still_locked_at_the_bound_falls_back_loudly_with_the_fallbacks_result(tmp_path):
    # the operator itself, through the public API: the holder never finishes within the bound
    name = native_build.extension_name(cpu._SOURCE, torch.backends.cpu.get_cpu_capability())
    program = """
import os, warnings
import torch
from sage_kernels import LossConfig, fused_linear_sage_loss
warnings.simplefilter("always")
gen = torch.Generator().manual_seed(0)
hidden, weight = torch.randn(2, 9, 16, generator=gen), torch.randn(300, 16, generator=gen)
args = (hidden, weight, torch.randint(0, 300, (2, 9), generator=gen), torch.ones(2, 9, dtype=torch.bool),
        torch.randn(2, generator=gen))
first = fused_linear_sage_loss(*args, config=LossConfig(beta=0.0), backend="cpu").loss
os.environ["SAGE_CPU_NATIVE"] = "0"
fallback = fused_linear_sage_loss(*args, config=LossConfig(beta=0.0), backend="cpu").loss
print(bool(torch.equal(first, fallback)))
"""
    holder = _hold(tmp_path, name)
    try:
        result = subprocess.run(
            [sys.executable, "-c", program],
            cwd=_REPO,
            env=_env(tmp_path, 1),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        holder.communicate("done\n", timeout=30)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True"]
    fallbacks = [line for line in result.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(fallbacks) == 1, result.stderr
    assert f"still held after 1 s by pid {holder.pid} on" in fallbacks[0] and "stop it if it is stuck" in fallbacks[0]
    assert f"{name}/{native_build.LOCK_FILE}" in fallbacks[0] and "chunked PyTorch path" in fallbacks[0]


@pytest.mark.parametrize("raw", ["soon", "-1", "nan"])
def test_a_bad_wait_is_refused_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(native_build.BUILD_WAIT_ENV, raw)
    with pytest.raises(ValueError, match=native_build.BUILD_WAIT_ENV):
        native_build.build_wait_seconds()


def test_the_wait_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(native_build.BUILD_WAIT_ENV, raising=False)
    assert native_build.build_wait_seconds() == native_build.DEFAULT_BUILD_WAIT_S
    monkeypatch.setenv(native_build.BUILD_WAIT_ENV, "2.5")
    assert native_build.build_wait_seconds() == 2.5


def test_env_switch_selects_the_pytorch_blocks(monkeypatch):
    monkeypatch.setenv(cpu.NATIVE_ENV, "0")
    assert cpu._ops_for(None) is cpu._TorchBlocks
    monkeypatch.setenv(cpu.NATIVE_ENV, "1")
    assert cpu._ops_for(None) is cpu.native_ops()
    assert cpu._ops_for(False) is cpu._TorchBlocks


def test_env_switch_gives_the_same_loss_through_the_public_api(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 9, 16, generator=gen), torch.randn(300, 16, generator=gen)
    token_ids, mask = torch.randint(0, 300, (2, 9), generator=gen), torch.rand(2, 9, generator=gen) > 0.2
    args = (hidden, weight, token_ids, mask, torch.randn(2, generator=gen))
    config = LossConfig(beta=0.0)
    native = fused_linear_sage_loss(*args, config=config).loss
    monkeypatch.setenv(cpu.NATIVE_ENV, "0")
    fallback = fused_linear_sage_loss(*args, config=config).loss
    torch.testing.assert_close(native, fallback, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "total, valid, vocab, hidden, expected",
    [
        (1024, 1024, 2048, 32, 63),  # N*V/16 caps the block below N/16 rows
        (1024, 10, 2048, 32, 10),  # never more rows than there are valid ones
        (4096, 4096, 151936, 896, 224),  # a quarter of the LM head (Qwen2.5-0.5B)
        (65536, 65536, 32000, 64, 131),  # the 16 MiB floor for a thin head
        (8, 8, 100, 4, 1),  # at least one row
    ],
)
def test_block_rows(total, valid, vocab, hidden, expected):
    rows = cpu.block_rows(total, valid, vocab, hidden)
    assert rows == expected
    assert rows == 1 or rows * vocab < total * vocab // 16
    budget = max(cpu.WORKSPACE_MIN_ELEMENTS, vocab * hidden * cpu.WORKSPACE_SHARE_OF_WEIGHT)
    assert rows * vocab <= max(vocab, budget)
