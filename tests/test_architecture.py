"""docs/architecture.md stays true, and the house rules hold (checked from the source).

Every module path the map names exists; in `sage_kernels` and `sage_train` no module is over
`MAX_LINES` lines and no module imports a private name (``_name``) of another of its package, nor
reaches one through a module it imported; the imports between `sage_kernels`' modules form no circle
(issue 39's done-when rules; `sage_train.study`'s design/endpoints/report loop is still open).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "docs" / "architecture.md"
MAX_LINES = 450
#: the packages whose modules the size and private-name rules hold (the circle rule: sage_kernels)
PACKAGES = ("sage_kernels", "sage_train")
#: a path the map names: inside backticks, from one of the repository's top-level folders.
NAMED_PATH = re.compile(r"`((?:sage_kernels|sage_train|benchmarks|tests|csrc|docs|scripts)/[\w/.-]*)`")


def package_modules(package: str = "sage_kernels") -> dict[str, Path]:
    """Every module of `package` by dotted name (a package by its ``__init__``)."""
    modules = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]):
    """(module imported, the name taken from it or None, the local name it is bound to) for every
    import in `path` of a module in `modules`, wherever it stands (module level, TYPE_CHECKING,
    inside a function); relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield alias.name, None, alias.asname
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:  # `from . import token_stage`: the module itself
                    yield f"{base}.{alias.name}", None, alias.asname or alias.name
                elif base in modules:
                    yield base, alias.name, alias.asname or alias.name


def test_the_map_exists_and_every_path_it_names_exists():
    text = MAP.read_text()
    named = set(NAMED_PATH.findall(text))
    assert len(named) > 30, "the map names the modules it describes"
    missing = sorted(path for path in named if not (ROOT / path.rstrip("/")).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_kernels_module_is_on_the_map():
    text = MAP.read_text()
    absent = [
        str(path.relative_to(ROOT))
        for path in package_modules().values()
        if path.name != "__init__.py" and f"`{path.relative_to(ROOT)}`" not in text
    ]
    assert not absent, f"sage_kernels modules missing from docs/architecture.md: {absent}"


ALL_MODULES = {name: path for package in PACKAGES for name, path in package_modules(package).items()}


@pytest.mark.parametrize("name, path", list(ALL_MODULES.items()), ids=list(ALL_MODULES))
def test_no_module_is_over_the_line_limit(name, path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES})"


def test_the_kernels_imports_form_no_circle():
    modules = package_modules()
    graph = {
        name: {target for target, *_ in imports_of(name, path, modules)} - {name} for name, path in modules.items()
    }
    # a package imports its submodules to export them: only a submodule importing back its own
    # package's __init__ would close a loop through it, so packages are left out of the walk
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    graph = {name: targets - packages for name, targets in graph.items() if name not in packages}
    state: dict[str, str] = {}

    def visit(node, trail):
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                raise AssertionError(f"import circle: {' -> '.join(trail[trail.index(target) :] + [target])}")
            if target not in state:
                visit(target, trail + [target])
        state[node] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_takes_a_private_name_from_another(package):
    modules = package_modules(package)
    found = []
    for name, path in modules.items():
        bound = set()  # the local names of the package's modules it imported
        for target, taken, local in imports_of(name, path, modules):
            if taken is None:
                bound.add(local)
            elif taken.startswith("_") and not taken.startswith("__"):
                found.append(f"{name} imports {target}.{taken}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                if node.attr.startswith("_") and not node.attr.startswith("__"):
                    found.append(f"{name} reads {node.value.id}.{node.attr}")
    assert not found, found
