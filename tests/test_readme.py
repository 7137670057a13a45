"""The README's loss example runs and gives a finite loss with gradients."""

import re
from pathlib import Path

import torch


def test_readme_loss_example_runs():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert torch.isfinite(scope["out"].loss)
    assert scope["hidden"].grad is not None and scope["weight"].grad.abs().sum() > 0
