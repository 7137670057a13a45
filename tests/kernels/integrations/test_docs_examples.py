"""Every fenced python block of docs/integrations.md runs as pasted: each is run verbatim in a fresh
process, offline, on CPU, from a folder where the TRL example's hub model name is a tiny local model."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[3] / "docs" / "integrations.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
HUB_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"  # the TRL example's model


def needs(block: str) -> list:
    return [name for name in ("liger_kernel", "trl") if f"from {name}" in block or f"integrations.{name}" in block]


def test_the_doc_has_its_four_examples():
    assert len(BLOCKS) == 4
    assert [bool(needs(block)) for block in BLOCKS] == [True, True, False, False]  # Liger, TRL, verl, OpenRLHF


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=["liger", "trl", "verl", "openrlhf"][: len(BLOCKS)])
def test_block_runs_as_pasted(index, tiny_lm_dir, tmp_path):
    block = BLOCKS[index]
    for name in needs(block):
        pytest.importorskip(name)
    if HUB_MODEL in block:  # a local folder of that name is what from_pretrained loads, offline
        (tmp_path / HUB_MODEL).parent.mkdir(parents=True)
        (tmp_path / HUB_MODEL).symlink_to(tiny_lm_dir)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, as on a machine without a GPU
    result = subprocess.run(
        [sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    if index == 0:  # guide off: Liger's loss, KL and clipped fraction
        lines = out.splitlines()
        assert lines[0].split()[1:] == lines[1].split()[3:]
    elif HUB_MODEL in block:
        assert "sage/q_mean" in out
    else:  # verl, OpenRLHF
        assert "anchor kl" in out
