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


def test_readme_pip_route_installs_the_makefiles_torch_from_the_checkout():
    """scripts/pip_route.sh (make pip-route, run by .ci/run) runs these blocks as pasted; here, that they
    exist and install the torch the Makefile installs, first, then this checkout."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    torch_pin = re.search(r"^TORCH\s*\?=\s*(\S+)$", (root / "Makefile").read_text(), re.M).group(1)
    for name, install in (("pip-route", "pip install ."), ("pip-route-wheel", "pip install dist/sage_rl-*.whl")):
        block = re.search(rf"<!-- {name} -->\n```bash\n(.*?)```\n<!-- /{name} -->", readme, re.S)
        assert block, name
        commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
        assert f"pip install {torch_pin}" in commands and install in commands, commands
        assert commands.index(f"pip install {torch_pin}") < commands.index(install)
