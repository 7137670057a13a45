"""A run directory received from someone else is data: `--resume` of a checkpoint whose files hold a
pickled function call (ours, rank0.pt, or DeepSpeed's model states) refuses with one line naming the
file, and runs nothing; a clean checkpoint of every ZeRO stage still resumes."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from sage_train import checkpoint
from sage_train.cli import train_main
from sage_train.run import train

STAGES = (0, 2, 3)


class _Payload:
    """Unpickling this calls os.system: what a crafted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _refit_manifest(step_dir: Path) -> None:
    """The manifest an attacker would rewrite, so that the sizes match the crafted files."""
    manifest = json.loads((step_dir / checkpoint.MANIFEST).read_text())
    manifest["files"] = {name: (step_dir / name).stat().st_size for name in manifest["files"]}
    (step_dir / checkpoint.MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory, distributed):
    """Per ZeRO stage, a 2-step run stopped after step 1 (checkpoint step1), and the config file of them."""
    import signal

    import yaml
    from run_copies import TINY_RUN

    from sage_train.config import build, resolve

    root = tmp_path_factory.mktemp("untrusted")
    values = {**TINY_RUN, "steps": 2, "save_every": 1, "keep_checkpoints": 0}
    (root / "tiny.yaml").write_text(yaml.safe_dump(values))

    def stop_after_1(step, row):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    for stage in STAGES:
        cfg = resolve(build({**values, "output_dir": str(root), "name": f"z{stage}", "zero_stage": stage}))
        assert train(cfg, on_step=stop_after_1)["steps_done"] == 1
    return root


def _resume(root: Path, config_dir: Path, stage: int, capsys) -> tuple[int, list[str]]:
    argv = ["--config", str(config_dir / "tiny.yaml"), f"--output_dir={root}", f"--name=z{stage}"]
    status = train_main([*argv, f"--zero_stage={stage}", "--resume"])
    return status, [line for line in capsys.readouterr().out.splitlines() if line.startswith("sage-train:")]


@pytest.mark.parametrize("crafted", ["rank0.pt", "mp_rank_00_model_states.pt"])
def test_a_crafted_checkpoint_is_refused_and_runs_nothing(checkpointed, tmp_path, capsys, crafted):
    shutil.copytree(checkpointed / "z0", tmp_path / "z0")
    marker = tmp_path / "payload-ran"
    newest = tmp_path / "z0" / "checkpoints" / "step000001"
    state = torch.load(newest / crafted, weights_only=False)  # the genuine file, extended by the payload
    state["extra"] = _Payload(marker)
    torch.save(state, newest / crafted)
    _refit_manifest(newest)
    status, lines = _resume(tmp_path, checkpointed, 0, capsys)
    assert status == 2 and len(lines) == 1, lines
    assert crafted in lines[0] and "posix.system" in lines[0] and "refused" in lines[0]
    assert not marker.exists()
    assert not (tmp_path / "z0" / "checkpoints" / "step000002").exists()


def test_load_data_refuses_any_global_but_the_allowed_ones(tmp_path):
    torch.save({"x": torch.ones(2), "rng": checkpoint.rng_state()}, tmp_path / "plain.pt")
    loaded = checkpoint.load_data(tmp_path / "plain.pt")
    assert torch.equal(loaded["x"], torch.ones(2)) and loaded["rng"]["python"] == checkpoint.rng_state()["python"]
    torch.save({"f": print}, tmp_path / "function.pt")  # a bare global, no call
    with pytest.raises(checkpoint.UntrustedFileError, match="print"):
        checkpoint.load_data(tmp_path / "function.pt")


@pytest.mark.parametrize("stage", STAGES)
def test_a_clean_checkpoint_of_every_zero_stage_resumes(checkpointed, capsys, stage):
    status, lines = _resume(checkpointed, checkpointed, stage, capsys)
    assert status == 0, lines
    assert json.loads((checkpointed / f"z{stage}" / "summary.json").read_text())["steps_done"] == 2
