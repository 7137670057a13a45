"""docs/architecture.md stays true, and the house rules hold (checked from the source).

Every module path the map names exists; in `sage_kernels`, `sage_train` and `benchmarks` no module is
over `MAX_LINES` lines, no module imports a private name (``_name``) of another module of the three,
nor reaches one through a module it imported, and the imports between their modules (wherever they
stand: module level or inside a function) form no circle; no metric name or run-directory entry name
is spelled outside its table (issue 39's done-when rules).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "docs" / "architecture.md"
MAX_LINES = 450
#: the packages whose modules the rules hold
PACKAGES = ("sage_kernels", "sage_train", "benchmarks")
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


def test_the_imports_form_no_circle():
    modules = ALL_MODULES
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
    modules = ALL_MODULES
    found = []
    for name, path in package_modules(package).items():
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


def named_once():
    """{name: its table module} for the names that must not be spelled outside their tables: the
    loss's metrics (`sage_kernels/metrics.py`), the trainer's (`sage_train/step_metrics.py`) and a run
    directory's entries (`sage_train/run_files.py`), with each metric family's ``prefix/``. A bare word
    (``kl``, ``loss``, ``reward``, ``eval``, ``final``, ``wandb``...) is left out: the same word names
    loss options, benchmark parts, toy settings and loggers, so only names with a ``/``, ``.`` or
    ``_`` are held."""
    from sage_kernels.metrics import METRIC_NAMES
    from sage_train.run_files import RUN_FILES
    from sage_train.step_metrics import STEP_METRICS

    tables = {
        "sage_kernels/metrics.py": METRIC_NAMES,
        "sage_train/step_metrics.py": tuple(vars(STEP_METRICS).values()),
        "sage_train/run_files.py": tuple(vars(RUN_FILES).values()),
    }
    names = {}
    for table, values in tables.items():
        for value in values:
            if re.search(r"[/._]", value):
                names[value] = table
            if "/" in value:
                names[value.split("/")[0] + "/"] = table
    return names


#: (module, name) spelled outside its table on purpose: sage-eval's own out folder has a file of the
#: same name as the run directory's (another folder's entry, named in sage-eval's records module)
SPELLED_ELSEWHERE = {("sage_train/eval/records.py", "completions.jsonl")}


def test_no_metric_or_run_file_name_is_spelled_outside_its_table():
    """Every string constant of the three packages (an f-string's literal parts included) that is a
    held name of `named_once`, or a metric family's ``prefix/``, stands in that name's table: a writer
    or reader takes it from the table (``RUN_FILES.metrics``, ``METRIC_NAME.q_max``,
    ``STEP_METRICS.reward``, `EXTREME_METRICS`)."""
    names = named_once()
    found = []
    for path in ALL_MODULES.values():
        module = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                if names[node.value] != module and (module, node.value) not in SPELLED_ELSEWHERE:
                    found.append(f"{module}:{node.lineno} spells {node.value!r} (its table: {names[node.value]})")
    assert not found, found


def imported_test_modules(path: Path) -> list[str]:
    """The modules `path` imports that are test modules (``test_*``) or a ``conftest``, as written."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # `from . import test_x` names the module in the alias; `from x import test_y` names a function
            names = [node.module or ""] + ([f"{node.module or ''}.{a.name}" for a in node.names] if node.level else [])
        else:
            continue
        for name in names:
            if any(part == "conftest" or part.startswith("test_") for part in name.split(".")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name.lstrip('.')}")
    return found


def test_no_test_imports_a_test_module_or_a_conftest():
    """Shared test helpers live in named helper modules (`tests/kernels/triton_harness.py`...) and
    fixtures in conftest.py: pytest imports each of the four conftest.py files as the module
    ``conftest``, so ``from conftest import`` takes whichever was loaded last, and a test module
    imported by another runs its module-level code (and may be collected) twice."""
    found = [line for path in sorted((ROOT / "tests").rglob("*.py")) for line in imported_test_modules(path)]
    assert not found, found


#: a reference in backticks: ``module.name``, ``package.module.Name``...
DOTTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`")
#: packages our modules are named after (`sage_train/rollout/vllm.py`, `sage_kernels/integrations/trl.py`...),
#: which may be absent here: ``vllm.LLM`` is theirs
PEERS = {"vllm", "trl", "verl", "openrlhf", "liger_kernel"}
#: the run's config and context, values whose fields share names with our functions (``cfg.deepspeed_config``)
VALUES = {"cfg", "ctx"}


def top_level_names(path: Path) -> set[str]:
    """The names a module defines or imports at its top level (inside an ``if`` or ``try`` there too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.col_offset == 0:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.col_offset == 0:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def unresolved_reference(ref: str, modules: dict[str, set[str]], defined: set[str]) -> bool:
    """Whether `ref` names a module of ours, or a name through a module, that is not there: a full
    path (``sage_train.x.y``) whose module is missing or lacks ``y``; ``x.Name`` (a class or table)
    that no module ``x`` of ours holds; ``x.function`` (the name of one of our functions) where no
    module of ours is named ``x`` (a module of ours may also name a value: `LossConfig` ``config.kl``)."""
    parts = ref.split(".")
    if parts[0] in ("sage_train", "sage_kernels"):
        for end in range(len(parts), 0, -1):
            module = ".".join(parts[:end])
            if module in modules:
                return end < len(parts) and not (parts[end] in modules[module] or f"{module}.{parts[end]}" in modules)
        return True
    first, second = parts[:2]
    if not first[0].islower() or first in VALUES or not (second[0].isupper() or second in defined):
        return False  # a value's attribute (`batch.completion_mask`), a class's (`LossConfig.loss_type`)
    holders = [name for name in modules if name.rpartition(".")[2] == first]
    if any(second in modules[name] or f"{name}.{second}" in modules for name in holders):
        return False
    if first in PEERS or importlib.util.find_spec(first) is not None:
        return False
    return not holders or second[0].isupper()


def test_docstrings_name_modules_that_exist():
    """Every module reference in the docstrings, comments and messages of sage_kernels and sage_train
    resolves (`unresolved_reference`): a module merged or renamed leaves no ``guide.GuideSettings``."""
    modules = {
        name: top_level_names(path)
        for package in ("sage_kernels", "sage_train")
        for name, path in package_modules(package).items()
    }
    defined = {
        node.name
        for name in modules
        for node in ast.parse(ALL_MODULES[name].read_text()).body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
    }
    found = [
        f"{ALL_MODULES[name].relative_to(ROOT)}:{lineno}: `{ref}`"
        for name in modules
        for lineno, line in enumerate(ALL_MODULES[name].read_text().splitlines(), 1)
        for ref in DOTTED.findall(line)
        if unresolved_reference(ref, modules, defined)
    ]
    assert len(modules) > 100 and not found, found


#: the stages of an RL step the map names, each a function `sage_train/step.py` calls
STEP_STAGES = {
    "collect_groups",
    "make_batch",
    "score",
    "rollout_correction",
    "group_advantages",
    "objective_advantages",
    "policy_update",
    "sync_weights",
}


def step_calls() -> list[str]:
    """The names of the functions an RL step calls, in step.py's order: `generate`'s body, then
    `rl_step`'s after its call of `generate`."""
    functions = {
        node.name: node
        for node in ast.parse((ROOT / "sage_train" / "step.py").read_text()).body
        if isinstance(node, ast.FunctionDef)
    }

    def calls(function, after=0):
        found = sorted(
            (node for node in ast.walk(function) if isinstance(node, ast.Call) and node.lineno > after),
            key=lambda node: (node.lineno, node.col_offset),
        )
        return [getattr(node.func, "attr", getattr(node.func, "id", "")) for node in found]

    rl_step_calls = [node for node in ast.walk(functions["rl_step"]) if isinstance(node, ast.Call)]
    line = next(node.lineno for node in rl_step_calls if getattr(node.func, "id", "") == "generate")
    return calls(functions["generate"]) + calls(functions["rl_step"], after=line)


def test_the_maps_rl_step_is_in_step_pys_order():
    """docs/architecture.md's "One RL step" names each stage (`STEP_STAGES`) in the order step.py
    runs them (the reference log-probs before the advantages, which may need them)."""
    section = MAP.read_text().split("### One RL step")[1].split("\n## ")[0]
    named = [ref.rpartition(".")[2] for ref in re.findall(r"`([\w.]+)`", section)]
    named = [name for name in named if name in STEP_STAGES]
    calls = step_calls()
    assert STEP_STAGES <= set(calls), f"step.py no longer calls {STEP_STAGES - set(calls)}"
    assert set(named) == STEP_STAGES, f"the map's RL step does not name {STEP_STAGES - set(named)}"
    remaining = iter(calls)
    in_order = all(name in remaining for name in named)  # `named` is a subsequence of `calls`
    assert in_order, f"the map's order {named} is not step.py's {[c for c in calls if c in STEP_STAGES]}"


def test_the_shared_errors_are_a_leaf():
    """`sage_train/errors.py` imports nothing of ours, so the lowest module may raise its errors;
    `safe_files` takes its errors from there, not from the config rules (with the tower of modules
    they stand on)."""
    ours = {name: list(imports_of(name, ALL_MODULES[name], ALL_MODULES)) for name in ("sage_train.errors",)}
    assert ours == {"sage_train.errors": []}
    safe_files = {
        target for target, *_ in imports_of("sage_train.safe_files", ALL_MODULES["sage_train.safe_files"], ALL_MODULES)
    }
    assert safe_files == {"sage_train.errors"}
