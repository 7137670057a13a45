"""What produced a result: library versions, the package's commit, the machine.

A study records this for every run it trains or evaluates (`sage_train.study`), so a published
number says which environment produced it, and a rerun that differs can be traced to a library
or commit change rather than guessed at.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path

LIBRARIES = ("torch", "transformers", "deepspeed", "triton", "numpy")


def environment() -> dict:
    """{python, torch, transformers, deepspeed, triton, numpy (None: not installed), commit, machine}."""
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {**versions, "commit": package_commit(), "machine": machine()}


def machine() -> dict:
    """{cpu (the model name), cores (usable by this process), threads (torch's intra-op threads)}."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_model(), "cores": cores, "threads": torch.get_num_threads()}


def cpu_model() -> str:
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        found = None
    return found.group(1).strip() if found else platform.processor() or platform.machine()


def package_commit():
    """The git commit of this package's source ("+dirty" when tracked files differ from it), or
    None outside a git checkout (an installed wheel)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None
