"""A received run or model folder whose files are not files: a FIFO (opening it blocks until someone
writes), a link to /dev/zero (reading it never ends), a dangling link, or JSON nested 100,000 deep
(Python's parser ends in a RecursionError). sage-eval and sage-train --resume look at each file
before they open it, read it with a bound, and end in one line naming it, exit 2, within seconds;
before, they hung or ended in a traceback."""

import os
import struct
from pathlib import Path

import pytest
import yaml
from run_copies import QUICK_RUN, snapshot
from tiny_models import tiny_model

from sage_train.checkpoint import tag_of
from sage_train.cli import eval_main, train_main
from sage_train.config import build, resolve
from sage_train.config_files import save_yaml
from sage_train.models.files import fingerprint
from sage_train.models.loading import build_char_tokenizer
from sage_train.run_files import RUN_FILES
from sage_train.safe_files import NotAFileError, read_bytes, read_json

#: no test here may take longer (a hang fails it instead of stalling the suite)
DEADLINE_S = 60
DEEP = 100_000


def nested(depth: int) -> bytes:
    return b'{"x": ' + b"[" * depth + b"]" * depth + b"}"


def make_fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def link_to_zero(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")


def deep_safetensors(path: Path) -> None:
    header = nested(DEEP)
    path.write_bytes(struct.pack("<Q", len(header)) + header)


#: what a sender puts in a run's final/: (the file, how), and a word the one line must hold
IN_FINAL = {
    "fifo tokenizer.json": ("tokenizer.json", make_fifo, "a FIFO"),
    "fifo beside the model": ("notes.txt", make_fifo, "a FIFO"),
    "link to /dev/zero": ("added_tokens.json", link_to_zero, "character device"),
    "dangling link": ("vocab.json", lambda p: p.symlink_to(p.parent / "gone"), "dangling link"),
    "deep safetensors header": ("model.safetensors", deep_safetensors, "nested too deeply"),
    "deep config.json": ("config.json", lambda p: p.write_bytes(nested(DEEP)), "too deeply"),
}


def errors(capsys, command: str) -> list[str]:
    captured = capsys.readouterr()
    return [line for line in (captured.out + captured.err).splitlines() if line.startswith(f"{command}:")]


@pytest.fixture
def finished(tmp_path) -> Path:
    """tmp_path/runs/done: a finished run's config.yaml and a real (tiny, untrained) final model."""
    run = tmp_path / "runs" / "done"
    tokenizer = build_char_tokenizer()
    tiny_model(tokenizer, layers=1, max_positions=64).save_pretrained(run / RUN_FILES.final)
    tokenizer.save_pretrained(run / RUN_FILES.final)
    config = resolve(build({**QUICK_RUN, "output_dir": str(tmp_path / "runs"), "name": "done"}))
    save_yaml(config.to_dict(), run / RUN_FILES.config)
    return run


@pytest.mark.timeout(DEADLINE_S)
@pytest.mark.parametrize("planted", sorted(IN_FINAL))
def test_sage_eval_refuses_a_final_model_file_that_is_not_a_file(capsys, finished, planted):
    name, plant, words = IN_FINAL[planted]
    plant(finished / RUN_FILES.final / name)
    before = snapshot(finished)
    status = eval_main(["--model", str(finished), "--n", "2", "--limit", "2", "--no-progress"])
    lines = errors(capsys, "sage-eval")
    assert status == 2 and len(lines) == 1, lines
    assert str(finished / RUN_FILES.final / name) in lines[0] and words in lines[0], lines[0]
    assert snapshot(finished) == before and not (finished / RUN_FILES.eval).exists()


@pytest.mark.timeout(DEADLINE_S)
@pytest.mark.parametrize("planted", ["deep safetensors header", "fifo tokenizer.json"])
def test_sage_train_refuses_such_a_model_in_one_line(capsys, finished, tmp_path, planted):
    name, plant, words = IN_FINAL[planted]
    plant(finished / RUN_FILES.final / name)
    status = train_main([f"--model={finished / RUN_FILES.final}", f"--output_dir={tmp_path / 'new'}", "--steps=1"])
    lines = errors(capsys, "sage-train")
    assert status == 2 and len(lines) == 1, lines
    assert "'model'" in lines[0] and str(finished / RUN_FILES.final / name) in lines[0] and words in lines[0]
    assert not (tmp_path / "new").exists()


#: what a sender puts in a run's checkpoints/ (a step folder step000002 is there): the file, how
IN_CHECKPOINTS = {
    "fifo latest": ("latest", make_fifo, "a FIFO"),
    "fifo manifest": (f"{tag_of(2)}/manifest.json", make_fifo, "a FIFO"),
    "latest linked to /dev/zero": ("latest", link_to_zero, "symbolic link"),
}


@pytest.mark.timeout(DEADLINE_S)
@pytest.mark.parametrize("planted", sorted(IN_CHECKPOINTS))
def test_resume_refuses_a_checkpoint_file_that_is_not_a_file(capsys, finished, planted, distributed):
    name, plant, words = IN_CHECKPOINTS[planted]
    (finished / RUN_FILES.checkpoints / tag_of(2)).mkdir(parents=True)
    plant(finished / RUN_FILES.checkpoints / name)
    (finished.parent / "quick.yaml").write_text(yaml.safe_dump(QUICK_RUN))
    before = snapshot(finished)
    argv = ["--config", str(finished.parent / "quick.yaml"), f"--output_dir={finished.parent}", "--name=done"]
    status = train_main([*argv, "--resume"])
    lines = errors(capsys, "sage-train")
    assert status == 2 and len(lines) == 1, lines
    assert Path(name).name in lines[0] and words in lines[0], lines[0]
    assert snapshot(finished) == before


@pytest.mark.timeout(DEADLINE_S)
def test_readers_refuse_what_is_not_a_regular_file_before_opening_it(tmp_path, finished):
    make_fifo(tmp_path / "fifo")
    link_to_zero(tmp_path / "zero")
    for path in (tmp_path / "fifo", tmp_path / "zero"):
        with pytest.raises(NotAFileError, match=str(path)):
            read_bytes(path, 1 << 20)
    (tmp_path / "big.json").write_bytes(b"[" + b"0," * 100 + b"0]")
    with pytest.raises(NotAFileError, match="more than a file of its kind may"):
        read_bytes(tmp_path / "big.json", 100)
    assert read_json(tmp_path / "big.json", 1000) == [0] * 101
    (tmp_path / "deep.json").write_bytes(nested(DEEP))
    with pytest.raises(ValueError, match="deep.json nests JSON arrays or objects too deeply"):
        read_json(tmp_path / "deep.json", 1 << 20)
    with pytest.raises(FileNotFoundError):
        read_bytes(tmp_path / "absent", 10)
    model = finished / RUN_FILES.final
    plain = fingerprint(str(model))
    (model / "extra").symlink_to("/dev/zero")
    with pytest.raises(NotAFileError, match="extra is not a regular file"):
        fingerprint(str(model))
    (model / "extra").unlink()
    assert fingerprint(str(model)) == plain
