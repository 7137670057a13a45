"""Peers' own functions, read from their published wheels, without their heavy dependencies.

verl 0.9.1 needs ray and pins transformers < 5.11; OpenRLHF 0.11.2's models import flash_attn.
Neither installs beside this project, but the functions the tests compare with (verl's policy
losses, ``kl_penalty`` and rollout-correction helpers; OpenRLHF's ``PolicyLoss`` and
``compute_approx_kl``) need torch alone. `peer_functions` takes them verbatim from the pinned wheel
(``pip download --no-deps`` into a cache outside the repository, checked by sha256), drops their
decorators (the peer's registries) and runs their definitions in a namespace holding the few names
their bodies use. Offline, without the wheel in the cache, the tests that need it are skipped.
"""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

#: name -> (pip requirement, wheel file, sha256 of the wheel)
WHEELS = {
    "verl": (
        "verl==0.9.1",
        "verl-0.9.1-py3-none-any.whl",
        "db6e6f2a8d9d5808d9ec32d357a42319fdc6967df688ff9d9810050f49bfdd14",
    ),
    "openrlhf": (
        "openrlhf==0.11.2",
        "openrlhf-0.11.2-cp311-cp311-manylinux1_x86_64.whl",
        "c969d70db03a70724c3d8a5a01186c6e0728bce624fb3dff95e39b5396acefa6",
    ),
}
CACHE = Path(os.environ.get("SAGE_PEER_CACHE", Path.home() / ".cache" / "sage-peers"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def wheel(name: str) -> Path:
    """The pinned wheel of peer `name` in the cache, downloaded once; skips the test when unreachable."""
    requirement, filename, digest = WHEELS[name]
    path = CACHE / filename
    if not path.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", requirement, "-d", str(CACHE)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0 or not path.is_file():
            pytest.skip(f"{requirement} could not be downloaded ({done.stderr.strip()[-200:]})")
    if _sha256(path) != digest:
        raise AssertionError(f"{path} does not have the pinned sha256 {digest}; delete it to download again")
    return path


def source(name: str, member_suffix: str) -> str:
    """The text of the file of peer `name`'s wheel whose path ends with `member_suffix`."""
    with zipfile.ZipFile(wheel(name)) as archive:
        (member,) = [m for m in archive.namelist() if m.endswith(member_suffix)]
        return archive.read(member).decode()


def _target(node) -> str | None:
    target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
    return getattr(target, "id", None)


def peer_functions(name: str, member_suffix: str, names, namespace: dict) -> dict:
    """The top-level functions, classes and assignments `names` of one peer file, defined verbatim
    (decorators dropped) in `namespace`, which supplies the names their bodies use; returns it."""
    tree = ast.parse(source(name, member_suffix))
    wanted = set(names)
    nodes = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in wanted:
            node.decorator_list = []
            nodes.append(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and _target(node) in wanted:
            nodes.append(node)
    found = {getattr(n, "name", None) or _target(n) for n in nodes}
    assert found == wanted, f"{member_suffix} of {name} lacks {sorted(wanted - found)}"
    module = ast.Module(body=nodes, type_ignores=[])
    exec(compile(module, f"<{name}:{member_suffix}>", "exec"), namespace)  # the peer's own code, as published
    return namespace
