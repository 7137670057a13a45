"""The README's loss examples run as pasted: the padded one and the packed one (cu_seqlens)."""

import re
from pathlib import Path

import torch

BLOCKS = re.findall(r"```python\n(.*?)```", (Path(__file__).resolve().parents[1] / "README.md").read_text(), re.S)


def run_block(code: str) -> dict:
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert torch.isfinite(scope["out"].loss)
    assert scope["hidden"].grad is not None and scope["weight"].grad.abs().sum() > 0
    return scope


def test_readme_has_the_padded_and_the_packed_example():
    assert len(BLOCKS) == 2 and "cu_seqlens" not in BLOCKS[0] and "cu_seqlens=cu_seqlens" in BLOCKS[1]


def test_readme_loss_example_runs():
    scope = run_block(BLOCKS[0])
    assert scope["out"].entropy.shape == (scope["B"], scope["L"])


def test_readme_packed_example_runs():
    scope = run_block(BLOCKS[1])
    assert scope["out"].entropy.shape == (scope["N"],)
    # rows outside the mask (the prompts) get no gradient; completion rows do
    mask = scope["mask"]
    assert bool((scope["hidden"].grad[~mask] == 0).all()) and bool((scope["hidden"].grad[mask] != 0).any())
