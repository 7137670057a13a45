"""The wheel a user installs: only the sage_* packages at the top level, with the data they need."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(out)],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("*.whl")
    return path


@pytest.fixture(scope="module")
def wheel_names(wheel):
    return zipfile.ZipFile(wheel).namelist()


def test_only_sage_packages_at_the_top_level(wheel_names):
    top = {name.split("/")[0] for name in wheel_names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"sage_kernels", "sage_train", "sage_bench"}


def test_every_module_of_the_packages_ships(wheel_names):
    """Each subpackage is listed in pyproject's packages (a folder left off ships without its modules)."""
    folders = {"sage_kernels": "sage_kernels", "sage_train": "sage_train", "benchmarks": "sage_bench"}
    modules = {
        f"{package}/{path.relative_to(ROOT / folder)}"
        for folder, package in folders.items()
        for path in (ROOT / folder).rglob("*.py")
    }
    assert sorted(modules - set(wheel_names)) == []


def test_the_wheel_version_is_the_package_version(wheel):
    import sage_kernels

    assert wheel.name.startswith(f"sage_rl-{sage_kernels.__version__}-")


def test_packaged_configs_and_math_sets_ship(wheel_names):
    assert "sage_train/configs/tiny-cpu.yaml" in wheel_names
    shipped = {Path(name).name for name in wheel_names if name.startswith("sage_train/tasks/data/math/")}
    assert shipped == {"math500.jsonl", "aime24.jsonl", "aime25.jsonl", "amc23.jsonl", "minerva_math.jsonl"}


def test_the_native_cpu_operator_source_ships_and_is_found_in_the_installed_package(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    shipped = tmp_path / "site" / "sage_kernels" / "csrc" / "sage_cpu.cpp"
    assert shipped.read_text() == (ROOT / "csrc" / "sage_cpu.cpp").read_text()
    found = subprocess.run(
        [sys.executable, "-c", "import sage_kernels.cpu as cpu; print(cpu._SOURCE)"],
        env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    )
    assert Path(found.stdout.strip()) == shipped.resolve()


def test_the_license_and_py_typed_ship_in_the_wheel(wheel_names, wheel):
    assert "sage_rl-0.1.0.dist-info/licenses/LICENSE" in wheel_names
    assert {"sage_kernels/py.typed", "sage_train/py.typed", "sage_bench/py.typed"} <= set(wheel_names)
    metadata = zipfile.ZipFile(wheel).read("sage_rl-0.1.0.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    shipped = zipfile.ZipFile(wheel).read("sage_rl-0.1.0.dist-info/licenses/LICENSE").decode()
    assert shipped == (ROOT / "LICENSE").read_text()


def test_the_license_is_the_apache_2_0_text():
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "9. Accepting Warranty or Additional Liability." in text and "END OF TERMS AND CONDITIONS" in text


def test_the_sdist_carries_the_license(tmp_path):
    """The source distribution, built by setuptools' own backend (no network, no isolation)."""
    import tarfile

    build = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path)], cwd=ROOT, check=True, capture_output=True, text=True
    )
    names = tarfile.open(tmp_path / done.stdout.strip().splitlines()[-1]).getnames()
    assert "sage_rl-0.1.0/LICENSE" in names and "sage_rl-0.1.0/sage_kernels/py.typed" in names
    assert "sage_rl-0.1.0/csrc/sage_cpu.cpp" in names


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_build_requires_the_setuptools_that_reads_an_spdx_license():
    """`license = "Apache-2.0"` (an SPDX expression) and `license-files` need setuptools >= 77."""
    project = _pyproject()
    assert project["project"]["license"] == "Apache-2.0" and project["project"]["license-files"] == ["LICENSE"]
    assert project["build-system"]["requires"] == ["setuptools>=77"]


def test_the_trl_extra_is_the_range_the_trainer_checks():
    pytest.importorskip("trl")
    from sage_kernels.integrations.trl import TRL_SUPPORTED

    extras = _pyproject()["project"]["optional-dependencies"]
    assert extras["trl"] == [f"trl>={TRL_SUPPORTED[0]},<{TRL_SUPPORTED[1]}"]
    assert f"trl>={TRL_SUPPORTED[0]},<{TRL_SUPPORTED[1]}" in extras["dev"]


def _inside(ours, theirs) -> bool:
    """Whether every version the specifier set `ours` allows, `theirs` allows, probed at both sets' bounds,
    just past each (a post-release, a fourth part) and far out (0, 9999)."""
    bounds = [spec.version for spec in [*ours, *theirs]]
    probes = ["0", "9999", *bounds, *(f"{b}.post1" for b in bounds), *(f"{b}.0.1" for b in bounds)]
    return all(theirs.contains(v, prereleases=True) for v in probes if ours.contains(v, prereleases=True))


def test_the_extras_ranges_sit_inside_trls_own():
    """Where TRL 1.16 (core or any extra) and one of ours name a package, ours is inside TRL's range:
    `vllm>=0.10.2,<0.34` let pip pick a vllm TRL refuses, `deepspeed>=0.15` one below TRL's floor."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    pytest.importorskip("trl")
    assert version("trl").startswith("1.16.")
    theirs: dict = {}
    for line in requires("trl"):
        requirement = Requirement(line)
        theirs[requirement.name.lower()] = theirs.get(requirement.name.lower(), SpecifierSet()) & requirement.specifier
    project = _pyproject()["project"]
    groups = [project["dependencies"], *project["optional-dependencies"].values()]
    ours = [Requirement(line) for group in groups for line in group]
    shared = [(r, theirs[r.name.lower()]) for r in ours if len(theirs.get(r.name.lower(), ""))]
    assert [str(r) for r, bounds in shared if not _inside(r.specifier, bounds)] == []
    assert {"vllm", "deepspeed", "transformers", "datasets", "liger-kernel", "numpy"} <= {r.name for r, _ in shared}
    assert not _inside(SpecifierSet(">=0.10.2,<0.34"), theirs["vllm"])  # the ranges of issue 47 were outside
    assert not _inside(SpecifierSet(">=0.15"), theirs["deepspeed"])


def test_the_console_scripts_go_through_the_extra_check():
    """The trainer's commands are `sage_train.entry`'s; the benchmarks' own is in the benchmarks
    (`sage_bench.cli.main`, which goes through `entry.run_command`)."""
    scripts = _pyproject()["project"]["scripts"]
    trainer = {
        name: f"sage_train.entry:{name.split('-')[1]}_main" for name in ("sage-train", "sage-eval", "sage-study")
    }
    assert scripts == {**trainer, "sage-bench": "sage_bench.cli:main"}


def test_every_console_script_names_a_function_the_wheel_ships(wheel, wheel_names):
    """The wheel's entry points are pyproject's, each in a module the wheel holds (sage-bench's in sage_bench)."""
    import configparser

    entry_points = configparser.ConfigParser(delimiters=("=",))
    entry_points.read_string(zipfile.ZipFile(wheel).read("sage_rl-0.1.0.dist-info/entry_points.txt").decode())
    scripts = dict(entry_points["console_scripts"])
    assert scripts == _pyproject()["project"]["scripts"]
    for target in scripts.values():
        module, function = target.split(":")
        source = zipfile.ZipFile(wheel).read(module.replace(".", "/") + ".py").decode()
        assert f"\ndef {function}(" in source, target


#: the console script's module and function, and its arguments
SCRIPTS = {
    "train": ("sage_train.entry", "train_main", "--output_dir={out}"),
    "eval": ("sage_train.entry", "eval_main", "--output_dir={out}"),
    "bench": ("sage_bench.cli", "main", "train"),
}


@pytest.mark.parametrize(
    "command, missing, extra",
    [("train", "deepspeed", "train"), ("eval", "yaml", "train"), ("bench", "transformers", "train")],
)
def test_a_command_without_its_extra_says_how_to_install_it(tmp_path, command, missing, extra):
    """`pip install sage-rl` without the extra: the console script ends in one line naming the install
    command (it ended in a ModuleNotFoundError traceback)."""
    module, function, argument = SCRIPTS[command]
    run = (
        f"import sys; sys.modules[{missing!r}] = None\n"
        f"sys.argv = ['sage-{command}', {argument.format(out=tmp_path)!r}]\n"
        f"from {module} import {function}; sys.exit({function}())"
    )
    done = subprocess.run([sys.executable, "-c", run], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == (
        f"sage-{command}: needs the '{extra}' extra (no module named {missing!r}): "
        f"pip install 'sage-rl[{extra}]' (README: Installing with pip)"
    )
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_citation_file_names_the_paper_and_this_version():
    import yaml

    import sage_kernels

    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0" and citation["version"] == sage_kernels.__version__
    paper = citation["preferred-citation"]
    assert paper["title"] == "SAGE: Shaping Anchors for Guided Exploration in RLVR of LLMs" and paper["year"] == 2026
    assert [a["family-names"] for a in paper["authors"]] == ["Lee", "Kang", "Hwang"]
