"""Nothing sage appends to or locks is written through a hard link: a copy of a run made with
``cp -al`` (every file a hard link to the original's) is resumed and evaluated, and the original run
stays byte for byte as it was; a run.lock hard-linked to a user's file leaves that file as it was.
O_NOFOLLOW does not see a hard link: each such file is first replaced by a copy of its own."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from run_copies import QUICK_RUN, link_copy, snapshot
from tiny_models import tiny_model

from sage_train.build import rollout_model_path
from sage_train.cli import eval_main, train_main
from sage_train.config import build, resolve
from sage_train.inputs import run_settings
from sage_train.models.loading import build_char_tokenizer
from sage_train.run_dir import RunLock
from sage_train.run_files import RUN_FILES
from sage_train.safe_files import open_append


@pytest.fixture(scope="module")
def finished(tmp_path_factory, distributed) -> Path:
    """runs/a: a finished 2-step run (checkpoints of both steps, its completions logged) that
    sage-eval has evaluated on seed 0 (eval/records.jsonl, eval/completions.jsonl)."""
    root = tmp_path_factory.mktemp("hard-links")
    (root / "quick.yaml").write_text(yaml.safe_dump(QUICK_RUN))
    assert train_main(["--config", str(root / "quick.yaml"), f"--output_dir={root / 'runs'}", "--name=a"]) == 0
    run = root / "runs" / "a"
    argv = ["--model", str(run), "--seeds", "0", "--n", "2", "--limit", "2", "--no-progress", "--save-completions"]
    assert eval_main(argv) == 0
    return run


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resuming_a_cp_al_copy_leaves_the_original_run_as_it_was(finished, tmp_path, capsys):
    copy = link_copy(finished, tmp_path / "runs2" / "a")
    before = snapshot(finished)
    assert os.stat(copy / RUN_FILES.completions).st_nlink == 2  # the copy shares the original's files
    argv = ["--config", str(finished.parents[1] / "quick.yaml"), f"--output_dir={copy.parent}", "--name=a"]
    assert train_main([*argv, "--resume", "--steps=3"]) == 0
    assert snapshot(finished) == before
    steps = [row["step"] for row in lines(copy / RUN_FILES.completions)]
    assert (
        steps == [row["step"] for row in lines(finished / RUN_FILES.completions)] + [3] * QUICK_RUN["log_completions"]
    )
    assert os.stat(finished / RUN_FILES.completions).st_nlink == 1


def test_evaluating_a_cp_al_copy_leaves_the_original_records_as_they_were(finished, tmp_path, capsys):
    copy = link_copy(finished, tmp_path / "runs2" / "a")
    before = snapshot(finished)
    argv = ["--model", str(copy), "--seeds", "0,1", "--n", "2", "--limit", "2", "--no-progress", "--save-completions"]
    assert eval_main(argv) == 0
    assert snapshot(finished) == before
    original, copied = lines(finished / "eval" / "records.jsonl"), lines(copy / "eval" / "records.jsonl")
    assert {r["seed"] for r in original} == {0} and {r["seed"] for r in copied} == {0, 1}
    assert copied[: len(original)] == original
    assert json.loads((copy / "eval" / "results.json").read_text())["resumed"] == len(original)


def test_open_append_gives_a_hard_linked_file_a_copy_of_its_own(tmp_path):
    (tmp_path / "outside.txt").write_text("the user's own lines\n")
    os.link(tmp_path / "outside.txt", tmp_path / "log.jsonl")
    os.chmod(tmp_path / "log.jsonl", 0o640)
    with open_append(tmp_path / "log.jsonl") as f:
        f.write("a new row\n")
    assert (tmp_path / "outside.txt").read_text() == "the user's own lines\n"
    assert (tmp_path / "log.jsonl").read_text() == "the user's own lines\na new row\n"
    assert os.stat(tmp_path / "log.jsonl").st_nlink == 1 and os.stat(tmp_path / "log.jsonl").st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl", "outside.txt"]  # no temporary left


def test_a_hard_linked_run_lock_leaves_the_file_it_shares_as_it_was_and_still_locks(tmp_path, capsys):
    (tmp_path / "elsewhere").mkdir()
    outside = tmp_path / "elsewhere" / "precious.txt"
    outside.write_text("a file of the user's own\n")
    (tmp_path / "run").mkdir()
    os.link(outside, tmp_path / "run" / RUN_FILES.lock)
    lock = RunLock(tmp_path / "run", 0)
    lock.acquire()
    try:
        assert outside.read_text() == "a file of the user's own\n" and os.stat(outside).st_nlink == 1
        holder = json.loads((tmp_path / "run" / RUN_FILES.lock).read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(ValueError, match="in use by pid"):  # the new file is the one locked
            RunLock(tmp_path / "run", 0).acquire()
    finally:
        lock.release()
    assert outside.read_text() == "a file of the user's own\n"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []


def test_the_rollout_model_of_a_cp_al_copy_is_saved_afresh(tmp_path, distributed):
    """A vLLM run saves its starting model to rollout_init/: into a new folder, so that a copy's
    hard-linked files (the original run's) are never overwritten. The copy's model is another one
    (its seed and position count): its config.json too differs from the original's."""
    tokenizer = build_char_tokenizer()
    for output, seed in (("runs", 0), ("runs2", 1)):
        if output == "runs2":
            link_copy(tmp_path / "runs" / "a", tmp_path / "runs2" / "a")
            before = snapshot(tmp_path / "runs" / "a")
        cfg = resolve(build({**QUICK_RUN, "rollout_engine": "vllm", "output_dir": str(tmp_path / output), "name": "a"}))
        model = tiny_model(tokenizer, seed=seed, layers=1, max_positions=64 * (1 + seed))
        saved = rollout_model_path(SimpleNamespace(settings=run_settings(cfg), model=cfg.model), model, tokenizer, 0)
        assert saved == str(cfg.run_dir / RUN_FILES.rollout_init)
    assert snapshot(tmp_path / "runs" / "a") == before
    assert snapshot(tmp_path / "runs2" / "a") != before  # the copy holds the other model
