"""Liger-Kernel's own GRPO tests (``test/chunked_loss/test_grpo_loss.py`` at v0.8.5) run on the drop-in.

    python scripts/liger_suite.py            (or `make liger-suite`; not part of `make test`)

1. Fetch: the test file and the helpers it imports (``test/__init__.py``, ``test/conftest.py``,
   ``test/utils.py``, ``test/chunked_loss/__init__.py``) of Liger-Kernel `LIGER_VERSION`, each
   checked against its sha256 in `LIGER_FILES` and kept in the cache (``--cache``, outside the
   repository). Sources, first that answers: a git clone of linkedin/Liger-Kernel holding the tag
   (``--liger-git``), the release's sdist from the package index (``pip download``; the sdist
   carries the tests), GitHub's raw files at the tag.
2. Substitute: in ``sage`` mode the file's two imports of Liger's GRPO loss become `substitutes()`:
   ``LigerFusedLinearGRPOLoss`` is ``FusedLinearSAGELoss.from_liger`` and ``liger_fused_linear_grpo``
   is ``fused_linear_grpo`` (one line each, so line numbers hold). Everything else in the file
   (Liger's torch reference, its other kernels) is Liger's. ``liger`` mode runs the file unchanged:
   the control.
3. Run pytest per mode (one process, ``--threads`` BLAS threads) and write each test's outcome and
   reason (`RESULTS` JSON, a markdown summary); the tests failing in ``sage`` mode run again in
   ``liger`` mode (``--control failed``) to say whether Liger fails them too.

Needs the installed liger-kernel (the file imports its reference pieces): the `dev` extra has it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_suite import counts, format_counts, outcome_of  # noqa: E402  (the scripts share the results format)

REPO = Path(__file__).resolve().parents[1]
LIGER_VERSION = "0.8.5"
LIGER_TAG = f"v{LIGER_VERSION}"
LIGER_FILES = {
    "test/__init__.py": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "test/conftest.py": "3f39ff918d1d31798bc727fd8949fd0589481707ced67614286b7d0d578de480",
    "test/utils.py": "367df4d2a52b56a0b6204906227cea3adfcc1eaa4e5723da7bdf188093d88e69",
    "test/chunked_loss/__init__.py": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "test/chunked_loss/test_grpo_loss.py": "3695de5504f83eb75b7ca429851220661022b4ca0b8e3200d6b8e6578114a2aa",
}
TEST_FILE = "test/chunked_loss/test_grpo_loss.py"
RAW_URL = "https://raw.githubusercontent.com/linkedin/Liger-Kernel/{tag}/{path}"
MODES = ("sage", "liger")
#: the file's imports of what the drop-in replaces, and the name each binds
IMPORTS = {
    "from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss": ("LigerFusedLinearGRPOLoss", 0),
    "from liger_kernel.chunked_loss.functional import liger_fused_linear_grpo": ("liger_fused_linear_grpo", 1),
}


def cache_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg).expanduser().resolve()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "sage-liger-suite"


# ---------------------------------------------------------------------------------------------- fetch


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _from_git(git: str, tag: str):
    git_dir = str(Path(git) / ".git") if (Path(git) / ".git").exists() else git

    def read(path: str) -> bytes:
        command = ["git", "--git-dir", git_dir, "show", f"{tag}:{path}"]
        return subprocess.run(command, capture_output=True, check=True).stdout

    return read


def _from_sdist(cache: Path, version: str):
    """The files of the release's sdist, downloaded once by pip (the index the user's pip is set to)."""
    folder = cache / "sdist"
    archives = sorted(folder.glob(f"liger_kernel-{version}.tar.gz"))
    if not archives:
        folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        subprocess.run(command + [f"liger-kernel=={version}", "-d", str(folder)], capture_output=True, check=True)
        archives = sorted(folder.glob(f"liger_kernel-{version}.tar.gz"))
    (archive,) = archives

    def read(path: str) -> bytes:
        with tarfile.open(archive) as tar:
            member = tar.extractfile(f"liger_kernel-{version}/{path}")
            if member is None:
                raise FileNotFoundError(path)
            return member.read()

    return read


def _from_github(tag: str):
    def read(path: str) -> bytes:
        with urllib.request.urlopen(RAW_URL.format(tag=tag, path=path), timeout=60) as response:
            return response.read()

    return read


def fetch_liger_tests(cache: Path, liger_git: str | None = None, sources=None, files=None) -> Path:
    """The pinned test files in ``cache/liger-<version>/``, each checked against its sha256. `sources`:
    (name, read(path) -> bytes) tried in order until one answers; a file whose digest differs from the
    pin stops the run (the pin is the contract). Returns that folder."""
    files = LIGER_FILES if files is None else files
    dest = cache / f"liger-{LIGER_VERSION}"
    if sources is None:
        sources = [("git", _from_git(liger_git, LIGER_TAG))] if liger_git else []
        sources += [("sdist", None), ("github", _from_github(LIGER_TAG))]
    errors = []
    for path, digest in files.items():
        target = dest / path
        if target.exists() and _sha256(target.read_bytes()) == digest:
            continue
        data = None
        for name, read in sources:
            try:
                read = read or _from_sdist(cache, LIGER_VERSION)
                data = read(path)
                break
            except Exception as error:  # an unreachable source: the next one
                errors.append(f"{name}: {type(error).__name__}: {error}")
        if data is None:
            raise SystemExit(f"{path} of Liger {LIGER_VERSION}: no source answered ({'; '.join(errors)})")
        if _sha256(data) != digest:
            raise SystemExit(f"{path} of Liger {LIGER_VERSION} from {name}: sha256 {_sha256(data)}, pinned {digest}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return dest


# ---------------------------------------------------------------------------------------- substitute


def substitutes(backend: str = "auto"):
    """(LigerFusedLinearGRPOLoss, liger_fused_linear_grpo) as the ``sage`` mode binds them."""
    import functools

    from sage_kernels import FusedLinearSAGELoss, fused_linear_grpo

    return (
        functools.partial(FusedLinearSAGELoss.from_liger, backend=backend),
        functools.partial(fused_linear_grpo, backend=backend),
    )


def substitute(source: str, mode: str, backend: str = "auto") -> str:
    """The test file with each import of `IMPORTS` replaced by the drop-in (one line each)."""
    for line in IMPORTS:
        if source.count(line + "\n") != 1:
            raise SystemExit(f"the test file does not import {line!r} exactly once: substitution not applied")
    if mode == "liger":
        return source
    for line, (name, index) in IMPORTS.items():
        new = f"from liger_suite import substitutes; {name} = substitutes({backend!r})[{index}]  # noqa"
        source = source.replace(line + "\n", new + "\n")
    return source


# ------------------------------------------------------------------------------------ pytest plugin

ROOT_CONFTEST = '''"""Written by scripts/liger_suite.py: the results file."""
import sys

sys.path.insert(0, {scripts!r})
from liger_suite import install_plugin  # noqa: E402

install_plugin(globals())
'''


def install_plugin(namespace: dict) -> None:
    """Into the run folder's conftest: a JSON line per test outcome."""
    results = open(os.environ["SAGE_LIGER_SUITE_RESULTS"], "a")

    def pytest_runtest_logreport(report):
        if report.when == "call" or report.outcome != "passed":
            results.write(json.dumps(outcome_of(report)) + "\n")
            results.flush()

    namespace["pytest_runtest_logreport"] = pytest_runtest_logreport


# ---------------------------------------------------------------------------------------------- run


def prepare_run(cache: Path, source_dir: Path, mode: str, backend: str) -> Path:
    """A run folder for ``mode``: Liger's ``test`` package (its test file substituted), a root
    conftest installing the plugin, a pytest.ini of its own (the run folder first on sys.path, so that
    ``test`` is Liger's package, not the standard library's)."""
    run = cache / "runs" / mode
    for path in LIGER_FILES:
        text = (source_dir / path).read_text()
        if path == TEST_FILE:
            text = substitute(text, mode, backend)
        (run / path).parent.mkdir(parents=True, exist_ok=True)
        (run / path).write_text(text)
    (run / "conftest.py").write_text(ROOT_CONFTEST.format(scripts=str(Path(__file__).resolve().parent)))
    (run / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\npythonpath = .\n")
    return run


def run_mode(cache: Path, source_dir: Path, mode: str, args, tests=None) -> list[dict]:
    run = prepare_run(cache, source_dir, mode, args.backend)
    results = cache / "results" / f"{mode}.jsonl"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text("")
    threads = str(args.threads)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "SAGE_LIGER_SUITE_RESULTS": str(results),
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
    }
    selection = [f"{TEST_FILE}::{test}" for test in tests] if tests else [TEST_FILE]
    command = [sys.executable, "-m", "pytest", "-q", "-rN"]
    command += ["-k", args.k] if args.k else []
    log_path = cache / "results" / f"{mode}.log"
    print(f"== {mode}: {len(tests) if tests else 'all'} tests, log {log_path}", flush=True)
    with open(log_path, "w") as log:
        status = subprocess.run(command + selection, cwd=run, env=env, stdout=log, stderr=subprocess.STDOUT)
    rows = [json.loads(line) for line in results.read_text().splitlines() if line]
    if not rows and status.returncode not in (0, 5):  # 5: nothing selected
        raise SystemExit(
            f"pytest exited {status.returncode} with no test run ({mode}):\n{log_path.read_text()[-3000:]}"
        )
    print(f"   {mode}: {format_counts(counts(rows))}", flush=True)
    return rows


def summary(by_mode: dict[str, list[dict]], control: dict[str, dict]) -> str:
    """Markdown: counts per mode, then each failure with its reason and whether Liger fails it too."""
    out = [f"Liger-Kernel {LIGER_VERSION} {TEST_FILE}, {versions()}", ""]
    out += ["| mode | total | passed | failed | skipped |", "|---|---|---|---|---|"]
    for mode, rows in by_mode.items():
        c = counts(rows)
        out.append(f"| {mode} | {sum(c.values())} | {c['passed']} | {c['failed']} | {c['skipped']} |")
    for mode, rows in by_mode.items():
        final = {row["test"]: row for row in rows}
        skips = Counter(row["reason"] for row in final.values() if row["outcome"] == "skipped")
        out += ["", f"### {mode}", ""]
        out += [f"- skipped {n}: {reason}" for reason, n in skips.most_common()]
        for test, row in sorted(final.items()):
            if row["outcome"] == "failed":
                liger = control.get(test)
                also = "" if liger is None or mode == "liger" else f" [Liger itself: {liger['outcome']}]"
                out.append(f"- FAILED {test}{also}: {row['reason']}")
    return "\n".join(out) + "\n"


def versions() -> str:
    from importlib.metadata import version

    import torch

    return f"liger-kernel {version('liger-kernel')} installed, torch {torch.__version__}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--liger-git", default=os.environ.get("LIGER_GIT"), help="a git clone of Liger-Kernel")
    parser.add_argument("--cache", help="fetched files, runs, results (default ~/.cache/sage-liger-suite)")
    parser.add_argument("--modes", default="sage", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument(
        "--control", choices=("failed", "none"), default="failed", help="rerun sage's failures on Liger"
    )
    parser.add_argument("--backend", default="auto", help="the drop-in's backend (auto: cpu without CUDA)")
    parser.add_argument("-k", help="pytest -k expression")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in MODES:
            parser.error(f"mode {mode!r}: one of {', '.join(MODES)}")
    cache = cache_dir(args.cache)
    source_dir = fetch_liger_tests(cache, args.liger_git)
    by_mode = {mode: run_mode(cache, source_dir, mode, args) for mode in modes}
    control = {row["test"]: row for row in by_mode.get("liger", [])}
    failed = sorted({r["test"] for r in by_mode.get("sage", []) if r["outcome"] == "failed"})
    if failed and args.control == "failed" and "liger" not in by_mode:
        control = {row["test"]: row for row in run_mode(cache, source_dir, "liger", args, failed)}
    text = summary(by_mode, control)
    (cache / "results" / "summary.md").write_text(text)
    (cache / "results" / "results.json").write_text(json.dumps({"by_mode": by_mode, "control": control}, indent=1))
    print(text)
    print(f"results: {cache / 'results'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
