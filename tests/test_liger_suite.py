"""scripts/liger_suite.py's pieces, offline and small: the pinned fetch (sources in order, the sha256
check), the substitution of Liger's two imports, what the substitutes are, and the run folder in which
``test`` is Liger's package."""

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

SOURCE = (
    "import torch\n"
    "from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss\n"
    "from liger_kernel.chunked_loss.functional import liger_fused_linear_grpo\n"
    "from test.utils import set_seed\n"
)


@pytest.fixture(scope="module")
def suite():
    sys.path.insert(0, str(SCRIPTS))  # liger_suite imports trl_suite's result helpers
    spec = importlib.util.spec_from_file_location("liger_suite", SCRIPTS / "liger_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["liger_suite"] = module
    spec.loader.exec_module(module)
    return module


def test_substitute_replaces_both_imports_line_for_line(suite):
    out = suite.substitute(SOURCE, "sage", "cpu").splitlines()
    assert out[1] == "from liger_suite import substitutes; LigerFusedLinearGRPOLoss = substitutes('cpu')[0]  # noqa"
    assert out[2] == "from liger_suite import substitutes; liger_fused_linear_grpo = substitutes('cpu')[1]  # noqa"
    assert len(out) == len(SOURCE.splitlines()) and out[3] == "from test.utils import set_seed"
    assert suite.substitute(SOURCE, "liger") == SOURCE
    with pytest.raises(SystemExit, match="exactly once"):
        suite.substitute(SOURCE.replace("from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss\n", ""), "sage")


def test_substitutes_are_the_drop_in(suite):
    import torch

    from sage_kernels import FusedLinearSAGELoss

    module_factory, functional = suite.substitutes("reference")
    module = module_factory(beta=0.0, use_ref_model=False, loss_type="bnpo", compiled=True, chunk_size=4)
    assert isinstance(module, FusedLinearSAGELoss) and module.backend == "reference"
    assert (module.config.loss_type, module.config.guide, module.config.beta) == ("bnpo", "none", 0.0)
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 3, 4, generator=g), torch.randn(5, 4, generator=g), torch.randint(0, 5, (2, 3)))
    args += (torch.ones(2, 3), torch.randn(2, generator=g))
    loss, metrics = functional(*args, beta=0.0, use_ref_model=False, loss_type="bnpo")
    assert loss.item() == module(*args)[0].item() and len(metrics) == 1


def _pinned(files: dict) -> dict:
    return {path: hashlib.sha256(data).hexdigest() for path, data in files.items()}


def test_fetch_tries_the_sources_in_order_and_checks_the_pin(suite, tmp_path):
    files = {"test/__init__.py": b"", "test/chunked_loss/test_grpo_loss.py": b"def test_one():\n    pass\n"}
    asked = []

    def unreachable(path):
        asked.append(("unreachable", path))
        raise OSError("no route to host")

    def serving(path):
        asked.append(("serving", path))
        return files[path]

    sources = [("unreachable", unreachable), ("serving", serving)]
    dest = suite.fetch_liger_tests(tmp_path / "cache", sources=sources, files=_pinned(files))
    assert dest == tmp_path / "cache" / f"liger-{suite.LIGER_VERSION}"
    assert {p: (dest / p).read_bytes() for p in files} == files
    assert asked == [(name, p) for p in files for name in ("unreachable", "serving")]
    asked.clear()  # cached and still matching the pin: nothing is fetched again
    suite.fetch_liger_tests(tmp_path / "cache", sources=sources, files=_pinned(files))
    assert asked == []
    wrong = {**_pinned(files), "test/__init__.py": "0" * 64}
    with pytest.raises(SystemExit, match="from serving: sha256 e3b0c442"):
        suite.fetch_liger_tests(tmp_path / "other", sources=sources, files=wrong)
    with pytest.raises(SystemExit, match="no source answered.*no route to host"):
        suite.fetch_liger_tests(tmp_path / "none", sources=sources[:1], files=_pinned(files))


def test_fetch_from_a_git_clone_at_the_tag(suite, tmp_path):
    repo = tmp_path / "liger"
    text = b"def test_one():\n    assert True\n"
    (repo / "test").mkdir(parents=True)
    (repo / "test" / "test_x.py").write_bytes(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    subprocess.run(git + ["tag", suite.LIGER_TAG], check=True)
    sources = [("git", suite._from_git(str(repo), suite.LIGER_TAG))]
    dest = suite.fetch_liger_tests(tmp_path / "cache", sources=sources, files=_pinned({"test/test_x.py": text}))
    assert (dest / "test" / "test_x.py").read_bytes() == text


def test_the_run_folder_imports_ligers_test_package_and_records_outcomes(suite, tmp_path, monkeypatch):
    """A stand-in `test` package with the pinned layout: pytest in the run folder imports it (not the
    standard library's `test`) and the plugin writes one JSON row per outcome."""
    source = tmp_path / "source"
    files = {
        "test/__init__.py": "",
        "test/conftest.py": "",
        "test/utils.py": "WHERE = 'liger'\n",
        "test/chunked_loss/__init__.py": "",
        suite.TEST_FILE: "from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss\n"
        "from liger_kernel.chunked_loss.functional import liger_fused_linear_grpo\n"
        "from test.utils import WHERE\n\n\n"
        "def test_package():\n    assert WHERE == 'liger'\n\n\n"
        "def test_substituted():\n    assert LigerFusedLinearGRPOLoss.func.__name__ == 'from_liger'\n\n\n"
        "def test_fails():\n    assert 1 == 2\n",
    }
    for path, text in files.items():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_text(text)
    monkeypatch.setattr(suite, "LIGER_FILES", dict.fromkeys(files, ""))
    args = type("Args", (), {"backend": "reference", "threads": 1, "k": None})()
    rows = suite.run_mode(tmp_path / "cache", source, "sage", args)
    assert {row["test"]: row["outcome"] for row in rows} == {
        "test_package": "passed",
        "test_substituted": "passed",
        "test_fails": "failed",
    }
    assert "assert 1 == 2" in next(row["reason"] for row in rows if row["test"] == "test_fails")
    saved = (tmp_path / "cache" / "results" / "sage.jsonl").read_text().splitlines()
    assert [json.loads(line)["test"] for line in saved] == [row["test"] for row in rows]
