"""docs/architecture.md's recipes ("Where to add") name every file a real addition of their kind
changed (issue 50 item 6): each recipe is held to the commits that last made such an addition
(`ADDITIONS`), read from the repository's history with git.

A file those commits touched counts where it is a product file (`PRODUCT`: the packages, csrc/,
docs/, README.md, pyproject.toml); tests are the recipe's "tests", named by example. The file is
followed to its path now through the renames git records since; one a later commit split or moved
by hand is followed through `Addition.moved`, and work that rode in the same commits but is no part
of the addition is set aside in `Addition.aside`, with its reason. Both tables are checked against
the history, so neither can go stale. Without the history (a shallow clone, an unpacked sdist) the
history tests skip, saying why; they never fail for it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "docs" / "architecture.md"
#: a path a recipe names, in backticks: under one of the repository's top-level folders, or a top-level file
RECIPE_PATH = re.compile(
    r"`((?:sage_kernels|sage_train|benchmarks|tests|csrc|docs|scripts)/[\w/.-]*|README\.md|pyproject\.toml)`"
)
#: the files an addition's commits touched that its recipe must name
PRODUCT = ("sage_kernels/", "sage_train/", "benchmarks/", "csrc/", "docs/", "README.md", "pyproject.toml")
#: files a recipe names one by one; the rest (counts, figures, a study.json) may be named by their folder
NAMED_ONE_BY_ONE = (".py", ".cpp", ".md", ".yaml", ".toml")


@dataclass(frozen=True)
class Addition:
    """The commits that last added one of a recipe's kind (full ids, oldest first). `aside`: a file
    they touched (its path then) that is no part of the addition -> why. `moved`: a file they touched
    (its path then) whose part in the addition lives elsewhere now, not by a rename git detects ->
    (its home now, the commit that moved it there)."""

    commits: tuple[str, ...]
    aside: dict[str, str] = field(default_factory=dict)
    moved: dict[str, tuple[str, str]] = field(default_factory=dict)


#: each recipe's heading on the map -> the last addition of its kind
ADDITIONS = {
    "A loss type": Addition(
        commits=(
            "8ed811a74d33161da81172bbd7466c7830baf544",  # DPPO's dppo_tv and dppo_kl, verl's sage_dppo_*
            "4f0083dd35ebcaa65d264c3ba7bc8c6ece5c74d1",  # their docs: loss.md, integrations.md, README's presets
        ),
        aside={"docs/recipes.md": "4f0083d also documented the rollout-mismatch keys (c3a7665's correction)"},
    ),
    "A rollout engine": Addition(
        commits=(
            "ad0e019c45c3793bad843cd26ebf9fd65314edb7",  # the vLLM engines, colocated and a server's (now openai)
            "18a8ee87fbc302880714a976a0cf3e8a65583cd9",  # made by name in make_engine, their config keys
        ),
        aside={
            "sage_train/importance.py": "truncated importance sampling, a correction, came in ad0e019",
            "sage_train/lora.py": "LoRA through peft came in 18a8ee8",
        },
        moved={
            # make_engine and its table moved beside the engines' interface
            "sage_train/rollout/__init__.py": (
                "sage_train/rollout/base.py",
                "27941f117c39676ddf12e992bee552e1ba260334",
            ),
            # trainer.py was split by concern: the engine is made from the config in build.py
            "sage_train/trainer.py": ("sage_train/build.py", "d4986aebe10bc6195160108f9df4a0695dc000d2"),
        },
    ),
    "A backend": Addition(
        commits=("4bc242975aac79493e25cb10a07f545a586464ca",),  # the cpu backend: cpu.py and its native operator
    ),
    "A rollout-mismatch correction": Addition(
        commits=(
            "c3a7665e54f55d5608b2b083753ba55fd76eba3c",  # TRL's vllm_importance_sampling_mode (IcePop), rollout_rs
            "4f0083dd35ebcaa65d264c3ba7bc8c6ece5c74d1",  # their docs: recipes.md's mismatch keys and metrics
        ),
        aside={
            "sage_train/presets.py": "c3a7665 also brought the DPPO presets (dppo-tv, dppo-kl), a loss type's",
            "README.md": "4f0083d's README change is the DPPO presets, a loss type's",
            "docs/loss.md": "4f0083d also documented DPPO's terms, a loss type's",
            "docs/integrations.md": "4f0083d also documented OpenRLHF's adapter and verl's DPPO losses",
        },
    ),
    "A study": Addition(
        commits=(
            "919e7dc1ba2dd0b9f2355029fd664f394ebe51b0",  # stage 3 registered: its config and PREREGISTRATION
            "f34a524cbbdac3805fc68120862d5b3509f18e2b",  # its row in the stages' figure
            "e4302e38ffd61b8b73c07665bd15ed313142e16f",  # reported as measured
            "2d0f84154e0fc73d48ea8718d3d6043a27406cf2",  # docs/results/README.md's words for it
        ),
        aside={
            "sage_train/study/design.py": "919e7dc also gave sage-study reuse of a stored study's counts",
            "sage_train/study/grid.py": "919e7dc also gave sage-study --store (each run's counts as it ends)",
            "sage_train/study/report.py": "919e7dc's reuse of stored counts, a sage-study feature",
            "sage_train/study/frontier.py": "f34a524 also drew the frontier panel beside the stages' figure",
        },
    ),
}


def recipes() -> dict[str, str]:
    """The map's recipes: each ``### heading`` of its "Where to add" section -> its text."""
    section = MAP.read_text().split("\n## Where to add\n", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^### (.+)$", section, flags=re.MULTILINE)
    return {heading.strip(): text for heading, text in zip(parts[1::2], parts[2::2])}


def named_in(kind: str) -> set[str]:
    """The paths the recipe `kind` names."""
    found = recipes()
    assert kind in found, f"docs/architecture.md's 'Where to add' has no recipe '### {kind}' (it has {list(found)})"
    return set(RECIPE_PATH.findall(found[kind]))


def is_named(path: str, named: set[str]) -> bool:
    """Whether `path` is named: itself, or (a data file) a folder above it."""
    if path in named:
        return True
    return not path.endswith(NAMED_ONE_BY_ONE) and any(n.endswith("/") and path.startswith(n) for n in named)


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def require_history(commits) -> None:
    """Skip, saying why, unless git and every commit of `commits` with its first parent are here."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the recipes are checked against the repository's history")
    inside = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-inside-work-tree"], capture_output=True)
    if inside.returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout: the recipes are checked against its history")
    for sha in commits:
        found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{sha}^1^{{commit}}"], capture_output=True)
        if found.returncode != 0:
            pytest.skip(f"commit {sha[:7]} or its parent is not in this clone (a shallow one? git fetch --unshallow)")


def touched(sha: str, *, deleted: bool = False) -> set[str]:
    """The files commit `sha` changed against its first parent (a merge: what it brought to the
    branch), without the ones it deleted unless `deleted`."""
    return set(git("diff", "--name-only", *(() if deleted else ("--diff-filter=d",)), f"{sha}^1", sha).split())


def path_now(path: str, since: str) -> str:
    """`path` followed through every rename git records from commit `since` to HEAD."""
    renames = {}
    for line in git(
        "log", "--reverse", "-M", "--diff-filter=R", "--name-status", "--format=", f"{since}..HEAD"
    ).splitlines():
        _, old, new = line.split("\t")
        renames[old] = new
    seen = set()
    while path in renames and path not in seen:
        seen.add(path)
        path = renames[path]
    return path


def test_the_map_has_each_recipe():
    assert set(ADDITIONS) <= set(recipes()), f"docs/architecture.md lacks recipes {set(ADDITIONS) - set(recipes())}"


@pytest.mark.parametrize("kind", list(ADDITIONS))
def test_every_file_a_recipe_names_exists(kind):
    named = named_in(kind)
    missing = sorted(path for path in named if not (ROOT / path.rstrip("/")).exists())
    assert not missing, f"the recipe {kind!r} names files that do not exist: {missing}"
    assert any(path.startswith("tests/") for path in named), f"the recipe {kind!r} names no test"
    assert any(path.startswith(PRODUCT) for path in named), f"the recipe {kind!r} names no product file"


@pytest.mark.parametrize("kind", list(ADDITIONS))
def test_a_recipe_names_every_file_its_last_addition_touched(kind):
    """Every product file the addition's commits touched (followed to its path now) is named by the
    recipe, or set aside with its reason."""
    addition = ADDITIONS[kind]
    require_history(addition.commits)
    named = named_in(kind)
    unnamed = []
    for sha in addition.commits:
        for path in sorted(p for p in touched(sha) if p.startswith(PRODUCT) and p not in addition.aside):
            now = addition.moved[path][0] if path in addition.moved else path_now(path, sha)
            if not is_named(now, named):
                unnamed.append(f"{now} (touched by {sha[:7]}{f' as {path}' if now != path else ''})")
    assert not unnamed, f"the recipe {kind!r} on docs/architecture.md does not name {unnamed}"


@pytest.mark.parametrize("kind", list(ADDITIONS))
def test_the_set_aside_and_moved_files_are_in_the_history(kind):
    """Each file set aside or moved was touched by the addition's commits; each move's commit
    changed both the file's old path and its home now, and the home exists."""
    addition = ADDITIONS[kind]
    require_history(addition.commits + tuple(sha for _, sha in addition.moved.values()))
    by_addition = set().union(*(touched(sha) for sha in addition.commits))
    stale = sorted(path for path in {*addition.aside, *addition.moved} if path not in by_addition)
    assert not stale, f"{kind!r}: files set aside or moved that its commits did not touch: {stale}"
    for old, (home, sha) in addition.moved.items():
        assert {old, home} <= touched(sha, deleted=True), f"{sha[:7]} did not move {old} to {home}"
        assert (ROOT / home).is_file(), f"{home}, the home of {old}, does not exist"
