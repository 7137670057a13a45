"""Building the CPU backend's native operator: where the build is cached and the lock around it.

torch's extension loader guards a build with a file ``lock`` in the build folder: torch 2.13 deletes
it when done and waits forever while it exists (a build killed midway left it behind, and every later
first use hung without a word); torch 2.14 leaves it behind after every build. Its existence proves
nothing either way, so neither is read here. The build runs under a lock of our own, an advisory
``flock`` that the kernel drops when its holder dies, and a finished build writes a record
(`DONE_FILE`: a digest of the source, flags, name, torch and Python) beside its library. A later
process that finds the record loads the library at once, without the lock or torch's loader. A build
is interrupted only when its folder holds outputs without that record (or our lock file still names a
holder that died): it is then taken over (the outputs removed, with a note). A live holder, another
process building the same operator, is waited on for at most `BUILD_WAIT_ENV` seconds, with a note
naming the lock file, after which the waiter loads the holder's build. Past that bound, or when the
build fails, the caller gets False after one warning line and runs the PyTorch block loop instead.

Builds live in ``<TORCH_EXTENSIONS_DIR, else torch's default>/sage_kernels-<version>-torch<version>-
py<XY>/<name>``, the name carrying a digest of the source and the CPU capability (`extension_name`):
two versions, torch builds, sources or instruction sets never share (or rebuild in turn) one folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import socket
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch

from .version import __version__

#: seconds a first use waits for another process's build of the operator before falling back.
BUILD_WAIT_ENV = "SAGE_CPU_BUILD_WAIT"
#: a build takes ~10 s of compiler CPU time (35-40 s of wall time at a load of 13 on two cores);
#: waiting longer than this means it is stuck.
DEFAULT_BUILD_WAIT_S = 600.0
#: our lock, beside torch's own ``lock`` in the build folder.
LOCK_FILE = "sage_build.lock"
#: written once the library is built and loaded: its content is `build_record`'s digest.
DONE_FILE = "sage_build.done"
_POLL_S = 0.1


def extension_name(source: Path, capability: str) -> str:
    """The name the operator is built and cached under: the CPU capability and a digest of the source.
    Torch caches an extension in one folder per name, shared by every checkout on the machine; with
    one name, two checkouts whose sources differ rebuild that folder in turn, and a process can load
    the other checkout's build (a source that is absent is named by its path, for the warning)."""
    content = source.read_bytes() if source.is_file() else str(source).encode()
    return f"sage_cpu_{capability.lower()}_{hashlib.sha256(content).hexdigest()[:12]}"


def build_directory(name: str) -> Path:
    """The folder the extension `name` is built in, namespaced by this package's and torch's versions
    (torch's own default layout separates Python versions but not torch versions, and nothing at all
    under TORCH_EXTENSIONS_DIR)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(root) / f"sage_kernels-{__version__}-torch{torch.__version__}-{python}" / name


def build_record(source: Path, name: str, flags: list) -> str:
    """What a finished build of `name` was made from: the source, flags, torch and Python, as a digest."""
    parts = [name, *flags, torch.__version__, sys.version, source.read_bytes().hex()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def load_finished(directory: Path, name: str, record: str) -> bool:
    """Load the library of a finished build whose `DONE_FILE` holds `record`; False when there is none."""
    library = directory / f"{name}.so"
    try:
        finished = (directory / DONE_FILE).read_text() == record and library.is_file()
    except OSError:
        return False
    if finished:
        torch.ops.load_library(str(library))
    return finished


def default_build_root() -> str:
    """torch's default root for extension builds (`get_default_build_root`'s answer) without importing
    torch.utils.cpp_extension: with a CUDA build of torch on a machine without a GPU (torch 2.14 from
    PyPI on a CPU machine) that import logs "No CUDA runtime is found" in every process, including those
    that only load a finished build."""
    from torch import _appdirs

    return os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))


def build_wait_seconds() -> float:
    """The bound from `BUILD_WAIT_ENV` (seconds, 0 or more, ``inf`` to wait as long as it takes)."""
    raw = os.environ.get(BUILD_WAIT_ENV)
    if raw is None:
        return DEFAULT_BUILD_WAIT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not seconds >= 0:
        raise ValueError(f"{BUILD_WAIT_ENV}={raw!r}: expected a number of seconds, 0 or more (or inf)")
    return seconds


class BuildLock:
    """An exclusive lock on `directory`/`LOCK_FILE` that names its holder while it is held.

    The file is never deleted (a process waiting on it would then lock a file nobody else sees):
    it is emptied on release, so a record found in it on acquiring was left by a holder that died."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK_FILE
        self.previous = ""  # the record of a holder that died holding it, once acquired
        self._handle = None

    def holder(self) -> str:
        """Who holds it, as its holder recorded (pid, host, since when)."""
        try:
            return self.path.read_text().strip() or "a process that has not recorded itself yet"
        except OSError:
            return "an unknown process"

    def acquire(self, wait_s: float) -> bool:
        """Take the lock, waiting at most `wait_s` seconds (with one note) for its holder to finish."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")
        try:
            acquired = self._wait(handle, wait_s)
        except BaseException:
            handle.close()
            raise
        if not acquired:
            handle.close()
            return False
        handle.seek(0)
        self.previous = handle.read().strip()
        handle.truncate(0)
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {since}\n")
        handle.flush()
        self._handle = handle
        return True

    def _wait(self, handle, wait_s: float) -> bool:
        import fcntl  # POSIX only; elsewhere the ImportError makes the build fall back, loudly

        deadline, announced = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                if not announced:
                    warnings.warn(
                        f"sage_kernels: waiting up to {wait_s:g} s for another build of the native CPU "
                        f"operator (lock {self.path}, held by {self.holder()}); {BUILD_WAIT_ENV} sets "
                        f"the wait, SAGE_CPU_NATIVE=0 skips the operator",
                        UserWarning,
                        stacklevel=4,
                    )
                    announced = True
                time.sleep(min(_POLL_S, max(deadline - time.monotonic(), 0.0)))

    def release(self) -> None:
        """Empty the record and drop the lock (closing the file releases the flock)."""
        handle, self._handle = self._handle, None
        handle.truncate(0)
        handle.close()


def build_extension(source: Path, name: str, flags: list, wait_s: float | None = None) -> bool:
    """Compile and load `source` as the extension `name` in `build_directory(name)`, under `BuildLock`.

    `wait_s`: the most seconds to wait for another process's build (default: `build_wait_seconds`).
    False, after one warning line, when it cannot (no source, no compiler or ninja, a failed build,
    the lock still held at the bound)."""
    if not source.is_file():
        _warn_fallback(f"{source} not found: csrc/ ships with checkouts and wheels")
        return False
    wait_s = build_wait_seconds() if wait_s is None else wait_s
    directory = build_directory(name)
    lock = BuildLock(directory)
    try:
        record = build_record(source, name, flags)
        if load_finished(directory, name, record):  # the common case: built by an earlier process
            return True
        if not lock.acquire(wait_s):
            _warn_fallback(
                f"its build lock {lock.path} is still held after {wait_s:g} s by {lock.holder()}, a live "
                f"process: let its build finish, or stop it if it is stuck; {BUILD_WAIT_ENV} sets the wait"
            )
            return False
        try:
            if not load_finished(directory, name, record):  # else another process built it while we waited
                _load(source, name, flags, directory, lock)
                (directory / DONE_FILE).write_text(record)
        finally:
            lock.release()
        return True
    except Exception as error:  # no compiler, no headers, a failed build: fall back, loudly once
        _warn_fallback(failure_cause(error))
        return False


#: the lines of a failed build that say why: the compiler's errors, a program or file not found
_CAUSE = re.compile(r"\berror\b|not found|no such file|permission denied|cannot find|undefined reference", re.I)


def failure_cause(error: Exception) -> str:
    """A failed build's error in one line: its first line without the command torch appends ("Error
    building extension 'name'"), then the lines that give the cause (a compiler's error, "c++: not
    found"), not the long command lines between them."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    head = lines[0].split(": [", 1)[0]  # torch: "Error building extension 'name': [1/2] c++ -MMD ..."
    commands = (" -MMD ", " -shared ", " -c ")
    causes = [
        line
        for line in lines[1:]
        if _CAUSE.search(line)
        and not line.startswith(("FAILED", "ninja: build stopped"))
        and not any(c in line for c in commands)
    ]
    cause = "; ".join(dict.fromkeys(causes)) or (lines[-1] if len(lines) > 1 else "")
    return f"{head}: {cause[:400]}" if cause else head[:400]


def _load(source: Path, name: str, flags: list, directory: Path, lock: BuildLock) -> None:
    """torch's build and load, once `lock` is held and no finished build is there: outputs in the folder
    (or a record in our lock) are a killed build's and may be cut short (a truncated library that ninja
    deems current), so they go, torch's lock file with them (torch 2.13 would wait on it forever)."""
    from torch.utils.cpp_extension import load

    outputs = [path for path in directory.iterdir() if path.name != LOCK_FILE]
    if lock.previous or outputs:
        who = f"held by {lock.previous}" if lock.previous else f"its outputs left without {DONE_FILE}"
        for leftover in [directory / "lock", directory / DONE_FILE, *directory.glob("*.o"), *directory.glob("*.so")]:
            leftover.unlink(missing_ok=True)
        warnings.warn(
            f"sage_kernels: took over from an interrupted build of the native CPU operator ({who}) in "
            f"{directory}; rebuilding it",
            UserWarning,
            stacklevel=4,
        )
    if not (directory / f"{name}.so").is_file():
        warnings.warn(
            f"sage_kernels: building the native CPU operator in {directory} (first use: a one-off compile of "
            "~10 s of CPU time, longer on a busy machine)",
            UserWarning,
            stacklevel=4,
        )
    with _interpreter_scripts_on_path():
        load(
            name=name,
            sources=[str(source)],
            extra_cflags=["-O3", "-fopenmp", *flags],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )


@contextlib.contextmanager
def _interpreter_scripts_on_path():
    """The running interpreter's scripts folder (a venv's bin/, where the `ninja` dependency installs
    its program) first on PATH while building: torch looks for ninja on PATH only, which lacks it when
    the venv's python runs without the venv activated."""
    scripts = sysconfig.get_path("scripts")
    previous = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join(p for p in (scripts, previous) if p)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = previous


def _warn_fallback(reason: str) -> None:
    warnings.warn(
        f"sage_kernels: native CPU operator unavailable ({reason}); using the slower chunked PyTorch path",
        RuntimeWarning,
        stacklevel=4,
    )
