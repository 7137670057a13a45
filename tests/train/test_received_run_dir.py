"""A run directory (or sage-eval's / a study's --out) received from someone else never makes sage
write outside it, tried as a hostile sender would: links at the lock, at a run's folders and files
(at any depth), at the names of temporary files, a lock that is a folder or a FIFO, names too long
for the filesystem. Each is refused in one line before anything is written, or (``--overwrite``, a
planted temporary name) removed or ignored without being followed; the files the links point at are
left as they were."""

import os
import shutil
from pathlib import Path

import pytest
import yaml
from run_copies import TINY_RUN, snapshot
from tiny_models import tiny_model

from sage_train.cli import eval_main, study_main, train_main
from sage_train.config import build, parse_args, resolve
from sage_train.config_files import save_yaml
from sage_train.models.loading import build_char_tokenizer
from sage_train.run_dir import RunLock, prepare_run_dir
from sage_train.run_files import RUN_FILES
from sage_train.safe_files import RunDirError, write_file


def said(capsys) -> list[str]:
    """The lines sage-eval and sage-study wrote to stderr (not the progress bars of a fixture)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("sage-")]


def sage_train(capsys, *argv) -> tuple[int, list[str]]:
    status = train_main([str(a) for a in argv])
    out = capsys.readouterr().out
    return status, [line for line in out.splitlines() if line.startswith("sage-train:")]


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    """A folder outside the runs: a user's files that links in a received run point at."""
    folder = tmp_path / "elsewhere"
    (folder / "folder").mkdir(parents=True)
    (folder / "precious.txt").write_text("a file of the user's own\n")
    (folder / "folder" / "kept.txt").write_text("kept\n")
    return folder


@pytest.fixture
def received(tmp_path) -> Path:
    """tmp_path/runs/got: a run received from someone else (files of each kind, no checkpoint that
    loads: every refusal here comes before the run would read one), and tmp_path/tiny.yaml for it."""
    run = tmp_path / "runs" / "got"
    for name in ("final/model.safetensors", "sft/config.json", "eval/records.jsonl", "metrics.jsonl"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(f"{name} of the received run\n")
    save_yaml(
        resolve(build({**TINY_RUN, "output_dir": str(tmp_path / "runs"), "name": "got"})).to_dict(), run / "config.yaml"
    )
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_RUN))
    return run


def train_over(capsys, received: Path, *extra) -> tuple[int, list[str]]:
    root = received.parents[1]
    return sage_train(capsys, "--config", root / "tiny.yaml", f"--output_dir={root / 'runs'}", "--name=got", *extra)


# --- the lock ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [[], ["--overwrite"], ["--resume"]], ids=str)
def test_a_linked_run_lock_is_refused_and_the_file_it_points_at_is_untouched(capsys, received, elsewhere, extra):
    """Every command naming the run, a refused one too (a fresh run over a previous one):
    the lock linked to a user's file is neither truncated, written nor deleted."""
    (received / RUN_FILES.lock).symlink_to(elsewhere / "precious.txt")
    before, outside = snapshot(received), snapshot(elsewhere)
    status, lines = train_over(capsys, received, *extra)
    assert status == 2 and len(lines) == 1, lines
    assert "run.lock is a symbolic link" in lines[0], lines[0]
    assert snapshot(elsewhere) == outside and snapshot(received) == before


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_lock_that_is_not_a_file_is_one_line(capsys, received, kind):
    lock = received / RUN_FILES.lock
    lock.mkdir() if kind == "folder" else os.mkfifo(lock)
    status, lines = train_over(capsys, received, "--resume")
    assert status == 2 and len(lines) == 1 and "run.lock" in lines[0], lines
    with pytest.raises(RunDirError, match="run.lock"):
        RunLock(received, 0).acquire()


def test_a_linked_study_lock_is_refused_and_the_file_it_points_at_is_untouched(tmp_path, capsys, elsewhere):
    out = tmp_path / "study"
    out.mkdir()
    (out / "study.lock").symlink_to(elsewhere / "precious.txt")
    outside = snapshot(elsewhere)
    status = study_main(["--algorithms", "grpo", "--seeds", "0", "--steps", "1", "--out", str(out)])
    err = said(capsys)
    assert status == 2 and len(err) == 1 and "study.lock is a symbolic link" in err[0], err
    assert snapshot(elsewhere) == outside and (out / "study.lock").is_symlink()


# --- links among a run's files, at any depth -------------------------------------------------------------

LINKS = {
    # the link planted in the received run: (its path in the run, its target in `elsewhere`)
    "eval/": ("eval", "folder"),
    "checkpoints/": ("checkpoints", "folder"),
    "sft/": ("sft", "folder"),
    "final/": ("final", "folder"),
    "tensorboard/": ("tensorboard", "folder"),
    "wandb/": ("wandb", "folder"),
    "metrics.jsonl": ("metrics.jsonl", "precious.txt"),
    "config.yaml": ("config.yaml", "precious.txt"),
    "checkpoints/.partial/": ("checkpoints/.partial", "folder"),
    "checkpoints/step000002/rank0.pt": ("checkpoints/step000002/rank0.pt", "precious.txt"),
    "eval/records.jsonl": ("eval/records.jsonl", "precious.txt"),
    "wandb/wandb/": ("wandb/wandb", "folder"),
}


def plant(run: Path, elsewhere: Path, link: str) -> Path:
    where, target = LINKS[link]
    path = run / where
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(elsewhere / target)
    return path


@pytest.mark.parametrize("extra", [["--resume"], []], ids=["resume", "fresh"])
@pytest.mark.parametrize("link", sorted(LINKS))
def test_a_link_among_a_runs_files_is_refused_by_name(capsys, received, elsewhere, link, extra):
    path = plant(received, elsewhere, link)
    before, outside = snapshot(received), snapshot(elsewhere)
    status, lines = train_over(capsys, received, *extra)
    assert status == 2 and len(lines) == 1, lines
    assert f"{path.relative_to(received)} is a symbolic link" in lines[0], lines[0]
    assert snapshot(received) == before and snapshot(elsewhere) == outside


@pytest.mark.slow
def test_overwrite_removes_links_and_never_follows_them(capsys, received, elsewhere, distributed):
    """--overwrite replaces the previous run: its linked folders and files go as links, what they point
    at stays; the new run writes real folders of its own."""
    for link in ("checkpoints/", "eval/", "final/", "metrics.jsonl"):
        plant(received, elsewhere, link)
    outside = snapshot(elsewhere)
    status, lines = train_over(capsys, received, "--overwrite", "--steps=2", "--save_every=1")
    assert status == 0, lines
    assert snapshot(elsewhere) == outside
    for name in ("checkpoints", "final", "metrics.jsonl"):
        assert not (received / name).is_symlink() and (received / name).exists(), name
    assert not os.path.lexists(received / "eval")


@pytest.mark.slow
def test_planted_temporary_names_are_never_followed(capsys, tmp_path, elsewhere, distributed):
    """What the trainer used to stage its writes under fixed names (config.yaml.tmp, metrics.tmp, a
    summary's .summary.json.tmp): links planted there are ignored, not written through, on --resume."""
    root = tmp_path
    (root / "tiny.yaml").write_text(yaml.safe_dump(TINY_RUN))
    args = ["--config", root / "tiny.yaml", f"--output_dir={root / 'runs'}", "--name=run", "--save_every=1"]
    assert sage_train(capsys, *args, "--steps=2")[0] == 0
    run = root / "runs" / "run"
    for name in ("config.yaml.tmp", "metrics.tmp", ".summary.json.tmp", ".eval_after.json.tmp"):
        (run / name).symlink_to(elsewhere / "precious.txt")
    outside = snapshot(elsewhere)
    status, lines = sage_train(capsys, *args, "--steps=3", "--resume")
    assert status == 0, lines
    assert snapshot(elsewhere) == outside


# --- sage-eval's --out -----------------------------------------------------------------------------------


@pytest.fixture
def finished(tmp_path) -> Path:
    """tmp_path/runs/done: a finished run's config.yaml and a real (tiny, untrained) final model."""
    run = tmp_path / "runs" / "done"
    tokenizer = build_char_tokenizer()
    tiny_model(tokenizer, layers=1, max_positions=64).save_pretrained(run / "final")
    tokenizer.save_pretrained(run / "final")
    save_yaml(
        resolve(build({**TINY_RUN, "output_dir": str(tmp_path / "runs"), "name": "done"})).to_dict(),
        run / "config.yaml",
    )
    return run


@pytest.mark.parametrize("link", ["eval/", "eval/records.jsonl"])
def test_sage_eval_refuses_a_linked_out_and_writes_nothing_through_it(capsys, finished, elsewhere, link):
    """A run's default --out is <run>/eval: linked (or a file in it linked), nothing is written there."""
    if link == "eval/records.jsonl":
        (finished / "eval").mkdir()
    path = plant(finished, elsewhere, link)
    before, outside = snapshot(finished), snapshot(elsewhere)
    status = eval_main(["--model", str(finished), "--n", "2", "--limit", "2", "--no-progress"])
    err = said(capsys)
    assert status == 2 and len(err) == 1, err
    assert f"{path.relative_to(finished)} is a symbolic link" in err[0], err[0]
    assert snapshot(finished) == before and snapshot(elsewhere) == outside


def test_sage_eval_refuses_an_empty_dataset_before_writing_out(capsys, finished, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    out = tmp_path / "out"
    status = eval_main(["--model", str(finished), "--tasks", str(tmp_path / "empty.jsonl"), "--out", str(out)])
    err = said(capsys)
    assert status == 2 and len(err) == 1 and "'empty'" in err[0] and "no problem" in err[0], err
    assert not out.exists()


# --- names and paths -------------------------------------------------------------------------------------


def test_names_too_long_for_the_filesystem_are_one_line(capsys, tmp_path, finished):
    long = "n" * 300
    status, lines = sage_train(capsys, f"--output_dir={tmp_path}", f"--name={long}", "--steps=1")
    assert status == 2 and len(lines) == 1 and "'name'" in lines[0], lines
    status, lines = sage_train(capsys, f"--output_dir={tmp_path / long}", "--steps=1")
    assert status == 2 and len(lines) == 1 and "'output_dir'" in lines[0], lines
    assert study_main(["--algorithms", "grpo", "--steps", "1", "--out", str(tmp_path / long)]) == 2
    assert eval_main(["--model", str(finished), "--limit", "2", "--out", str(tmp_path / long / "eval")]) == 2
    err = said(capsys)
    assert [line.split(":")[0] for line in err] == ["sage-study", "sage-eval"], err
    assert "too long" in err[1], err
    assert not [name for name in os.listdir(tmp_path) if name.startswith("nnn")]


def test_output_dir_under_home_is_the_home_folders(tmp_path, monkeypatch, distributed):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    cfg = parse_args(["--output_dir=~/runs", "--name=mine"])
    assert cfg.run_dir == tmp_path / "home" / "runs" / "mine"
    prepare_run_dir(cfg, cfg.run_dir, 0, 1)
    assert (tmp_path / "home" / "runs" / "mine" / "config.yaml").is_file() and not (tmp_path / "~").exists()


def test_write_file_replaces_a_link_and_never_follows_it(tmp_path, elsewhere):
    (tmp_path / "summary.json").symlink_to(elsewhere / "precious.txt")
    outside = snapshot(elsewhere)
    write_file(tmp_path / "summary.json", "{}\n")
    assert (tmp_path / "summary.json").read_text() == "{}\n" and not (tmp_path / "summary.json").is_symlink()
    assert snapshot(elsewhere) == outside and sorted(p.name for p in tmp_path.iterdir()) == [
        "elsewhere",
        "summary.json",
    ]
