"""A run directory that stops taking new files at the end of a run (made immutable, as a read-only
folder would be) before eval_after.json or final/: the run stops with one `RunError` naming the file
and why, leaves run.lock naming no holder, and a resume once the folder is writable finishes."""

import subprocess

import pytest

from sage_train import checkpoint
from sage_train.distributed import RunError
from sage_train.run import train
from sage_train.run_files import RUN_FILES


def _chattr(flag: str, folder) -> bool:
    return subprocess.run(["chattr", flag, str(folder)], capture_output=True).returncode == 0


@pytest.fixture
def immutable(tmp_path):
    """chattr +i (root, on a file system that has it); skipped where it cannot be set."""
    probe = tmp_path / "probe"
    probe.mkdir()
    if not _chattr("+i", probe):
        pytest.skip("chattr +i is not available here (needs root on ext4 or the like)")
    _chattr("-i", probe)
    made = []
    yield lambda folder: made.append(folder) or _chattr("+i", folder)
    for folder in made:
        _chattr("-i", folder)


@pytest.mark.parametrize("blocked", ["eval_after.json", "final"])
def test_a_run_dir_that_takes_no_new_file_stops_cleanly_and_resumes(tiny_config, distributed, immutable, blocked):
    options = dict(steps=2, save_every=1, eval_problems=2 if blocked == "eval_after.json" else 0, eval_samples=2)
    cfg = tiny_config(name="ro", **options)

    def lock_the_folder(step, row):
        if step == cfg.steps:  # after its last metrics row, before its last checkpoint and the final files
            assert immutable(cfg.run_dir)

    with pytest.raises(RunError) as error:
        train(cfg, on_step=lock_the_folder)
    message = str(error.value)
    assert str(cfg.run_dir / blocked) in message and "is not writable" in message and "\n" not in message
    assert "--resume" in message
    assert (cfg.run_dir / RUN_FILES.lock).read_text() == ""  # no holder named: not a stale lock
    assert checkpoint.find(cfg.run_dir, 1)[0][0].name == checkpoint.tag_of(2)
    _chattr("-i", cfg.run_dir)
    summary = train(tiny_config(name="ro", resume=True, **options))
    assert summary["steps_done"] == 2 and not summary["interrupted"]
    assert (cfg.run_dir / "final" / "config.json").is_file() and not (cfg.run_dir / RUN_FILES.lock).exists()
