"""What a resume accepts, on real tiny runs: a run directory renamed or copied resumes under its new
name; a finished run extended with more ``steps`` continues exactly as a longer run would have (the
constant LR and the branch guide do not depend on ``steps``), and says what a schedule that does
depend on them does; fewer steps than its checkpoint are refused; metrics.jsonl rows that are JSON
but not rows are one line naming the row."""

import json
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
from run_copies import TINY_RUN

from sage_train import report
from sage_train.config import ConfigError, build, resolve
from sage_train.distributed import RunError
from sage_train.run import train

#: checkpoints every 2 steps; the held-out evaluation's problems are the first RL prompts
OPTIONS = {"steps": 6, "save_every": 2, "keep_checkpoints": 0, "lr": 3e-3}
EVALUATED = {"eval_problems": 2, "eval_samples": 2, "eval_splits": ["train"]}


def config(output: Path, name: str, **overrides):
    return resolve(build({**TINY_RUN, **OPTIONS, **EVALUATED, "output_dir": str(output), "name": name, **overrides}))


def metrics(run_dir: Path) -> list[dict]:
    return [report.without_timing(row) for row in report.read_metrics(Path(run_dir) / "metrics.jsonl")]


def assert_same_metrics(got: list[dict], expected: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for a, b in zip(got, expected):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, distributed):
    """A 6-step run, the same config stopped after step 4, and a finished 4-step run."""
    root = tmp_path_factory.mktemp("resume")
    whole = config(root, "whole")
    train(whole)

    def stop_after_4(step, row):
        if step == 4:
            signal.raise_signal(signal.SIGTERM)

    assert train(config(root, "stopped"), on_step=stop_after_4)["steps_done"] == 4
    train(config(root, "four", steps=4))
    return SimpleNamespace(root=root, whole=metrics(root / "whole"), eval_after=(root / "whole" / "eval_after.json"))


def copy_run(runs, name: str, tmp_path: Path, as_name: str) -> Path:
    shutil.copytree(runs.root / name, tmp_path / as_name)
    return tmp_path / as_name


def test_a_renamed_or_copied_run_resumes_under_its_new_name(runs, tmp_path):
    run_dir = copy_run(runs, "stopped", tmp_path, "renamed")
    summary = train(config(tmp_path, "renamed", resume=True))
    assert summary["name"] == "renamed" and summary["steps_done"] == 6
    assert_same_metrics(metrics(run_dir), runs.whole)


def test_a_finished_run_extended_with_more_steps_continues_as_a_longer_run_would(runs, tmp_path, capsys):
    run_dir = copy_run(runs, "four", tmp_path, "four")
    (run_dir / "eval_after.json").write_text('{"train": "the end of the 4-step run"}\n')
    summary = train(config(tmp_path, "four", resume=True))
    assert "--resume with steps 4 -> 6: steps 1..4 are kept" in capsys.readouterr().out
    assert summary["steps_done"] == summary["steps"] == 6 and not summary["interrupted"]
    assert_same_metrics(metrics(run_dir), runs.whole)
    after = json.loads((run_dir / "eval_after.json").read_text())
    assert after == json.loads(runs.eval_after.read_text())  # the 6-step model's, evaluated afresh


def test_an_extension_says_what_a_schedule_over_the_steps_does(runs, tmp_path, capsys):
    run_dir = copy_run(runs, "stopped", tmp_path, "stopped")
    cfg_file = run_dir / "checkpoints" / "step000004" / "config.yaml"
    for name in ("config.yaml", "checkpoints/step000004/config.yaml"):  # as if it had run a cosine decay
        path = run_dir / name  # (as many bytes: the checkpoint's manifest still holds)
        path.write_text(path.read_text().replace("lr_schedule: constant", "lr_schedule: cosine  "))
    assert "lr_schedule: cosine" in cfg_file.read_text()
    train(config(tmp_path, "stopped", resume=True, steps=8, lr_schedule="cosine"))
    out = capsys.readouterr().out
    assert "steps 6 -> 8" in out and "the cosine learning-rate decay follows the 8-step schedule from step 5 on" in out
    assert [row["step"] for row in metrics(run_dir)] == list(range(1, 9))


def test_fewer_steps_than_the_checkpoint_are_refused(runs, tmp_path):
    run_dir = copy_run(runs, "stopped", tmp_path, "stopped")
    before = (run_dir / "config.yaml").read_text()
    with pytest.raises(ConfigError, match="'steps' is 3, below step 4"):
        train(config(tmp_path, "stopped", resume=True, steps=3))
    assert (run_dir / "config.yaml").read_text() == before


@pytest.mark.parametrize("row", ["[1, 2]", "{}", '{"step": "2"}', '{"step": true}'])
def test_a_metrics_row_that_is_json_but_not_a_row_is_one_line(runs, tmp_path, row):
    run_dir = copy_run(runs, "stopped", tmp_path, "stopped")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[1] = row
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(RunError, match=r"line 2 is not a metrics row") as error:
        train(config(tmp_path, "stopped", resume=True))
    assert "\n" not in str(error.value)
