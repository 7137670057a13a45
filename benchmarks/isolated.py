"""Each part of a measurement in a process of its own, its rows appended to a JSONL file as it ends.

A part that dies (a CUDA fault, which poisons the whole process; an out-of-memory kill; a hang cut
by its timeout) loses only its own row, and the parent records it as failed with the exit code:
every later part still runs on a clean device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_module(module: str, argv: list[str], timeout_s: float | None = None) -> int:
    """`python -m module *argv` with the repository importable; its exit code (124: timed out)."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", module, *argv], env={**os.environ, "PYTHONPATH": path}, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return 124
    return proc.returncode


def read_rows(path: Path) -> list[dict]:
    """The rows of a JSONL file (none when it does not exist yet)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_row(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def run_parts(
    module: str,
    argv: list[str],
    parts: list[str],
    rows_path: Path,
    timeout_s: float | None,
    render: Callable[[list[dict]], object],
) -> list[dict]:
    """Run `python -m module` once per part (`argv` with ``--paths PART --part``), each appending its
    row to `rows_path` (emptied first); a part that exits non-zero gets a failed row. `render` is
    called with the rows so far as each part ends; returns them all."""
    rows_path.write_text("")
    for part in parts:
        code = run_module(module, [*_without_paths(argv), "--paths", part, "--part"], timeout_s)
        if code != 0:
            status = "failed: timed out" if code == 124 else f"failed: exit code {code}"
            append_row(rows_path, {"path": part, "status": status})
        render(read_rows(rows_path))
        print(f"{module}: {part} done (exit {code})", file=sys.stderr, flush=True)
    return read_rows(rows_path)


def _without_paths(argv: list[str]) -> list[str]:
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--paths":
            skip = True
        elif not item.startswith("--paths="):
            kept.append(item)
    return kept
