"""docs/integrations.md: its code blocks are excerpts of docs/examples/*.py, and those scripts run."""

import re
import runpy
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[3] / "docs"
EXAMPLES = DOCS / "examples"


def test_doc_code_blocks_are_excerpts_of_the_examples():
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "integrations.md").read_text(), flags=re.S)
    sources = [path.read_text() for path in EXAMPLES.glob("*.py")]
    assert len(blocks) >= 3
    for block in blocks:
        assert any(block in source for source in sources), f"not in docs/examples/:\n{block}"


def test_liger_example_runs(capsys):
    pytest.importorskip("liger_kernel")
    runpy.run_path(str(EXAMPLES / "liger_dropin.py"))["main"]()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[1:] == lines[1].split()[3:]  # guide off: Liger's loss, KL and clipped fraction


def test_verl_example_runs(capsys):
    runpy.run_path(str(EXAMPLES / "verl_sage.py"))["main"]()
    assert "anchor kl" in capsys.readouterr().out


def test_trl_example_runs(tiny_lm_dir, tmp_path):
    pytest.importorskip("trl")
    trainer = runpy.run_path(str(EXAMPLES / "trl_sage_grpo.py"))["main"](
        model=tiny_lm_dir, output_dir=str(tmp_path), max_steps=1, use_cpu=True
    )
    assert any("sage/q_mean" in entry for entry in trainer.state.log_history)
