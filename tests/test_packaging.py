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
