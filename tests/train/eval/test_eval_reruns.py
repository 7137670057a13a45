"""`sage-eval` run again, and given what it cannot use: a rerun with nothing left to sample finishes
(the same command twice, another --k, a two-model evaluation resumed after its first model); the
samples of a retrained model are refused, never credited to the new weights; a bad model directory,
a bad task or an overlong prompt exits 2 with one line before anything is written to --out; jsonl
problem files that are not JSON objects fail naming the file and line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tiny_models import tiny_model

from sage_train.cli import eval_main
from sage_train.models.loading import build_char_tokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """Two tiny char-level models that differ only in their weights (seeds 0 and 1)."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = build_char_tokenizer()
    for seed in (0, 1):
        tiny_model(tokenizer, seed=seed, layers=1, max_positions=64).save_pretrained(root / f"seed{seed}")
        tokenizer.save_pretrained(root / f"seed{seed}")
    return {seed: root / f"seed{seed}" for seed in (0, 1)}


def sage_eval(capsys, out: Path, *models_and_args) -> tuple[int, str]:
    argv = ["--tasks", "arithmetic", "--task-options", '{"arithmetic": {"digits": 1}}', "--n", "4", "--limit", "2"]
    argv += ["--max-new-tokens", "2", "--seeds", "0,1", "--no-progress", "--out", str(out)]
    status = eval_main([*map(str, models_and_args), *argv])
    return status, capsys.readouterr().err.strip()


def results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def test_the_same_command_twice_and_another_k_finish_without_sampling(models, tmp_path, capsys):
    assert sage_eval(capsys, tmp_path, "--model", models[0])[0] == 0
    first = results(tmp_path)
    status, err = sage_eval(capsys, tmp_path, "--model", models[0])
    assert status == 0, err
    assert results(tmp_path)["generated"] == 0 and results(tmp_path)["resumed"] == 2 * 2
    pass_at_k = [r["models"]["seed0"]["tasks"]["arithmetic"]["pass_at_k"] for r in (first, results(tmp_path))]
    assert pass_at_k[0] == pass_at_k[1]
    status, err = sage_eval(capsys, tmp_path, "--model", models[0], "--k", "1,3")
    assert status == 0, err
    assert sorted(results(tmp_path)["models"]["seed0"]["tasks"]["arithmetic"]["pass_at_k"]) == ["1", "3"]


def test_a_two_model_evaluation_killed_in_its_second_model_resumes(models, tmp_path, capsys):
    both = ["--model", models[0], "--model", models[1]]
    assert sage_eval(capsys, tmp_path, *both)[0] == 0
    records = (tmp_path / "records.jsonl").read_text().splitlines()
    kept = [r for r in records if json.loads(r)["model"] == "seed0"] + records[len(records) // 2 :][:1]
    (tmp_path / "records.jsonl").write_text("\n".join(kept) + "\n")  # the first model whole, one of the second
    (tmp_path / "results.json").unlink()
    status, err = sage_eval(capsys, tmp_path, *both)
    assert status == 0, err
    assert results(tmp_path)["resumed"] == len(kept) and results(tmp_path)["generated"] == len(records) - len(kept)


def test_a_retrained_models_old_samples_are_refused(models, tmp_path, capsys):
    """The same folder holding other weights (a run trained again): its records must not be reused."""
    model = tmp_path / "model"
    shutil.copytree(models[0], model)
    out = tmp_path / "eval"
    assert sage_eval(capsys, out, "--model", model)[0] == 0
    for name in ("model.safetensors", "config.json"):
        shutil.copy(models[1] / name, model / name)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    status, err = sage_eval(capsys, out, "--model", model)
    assert status == 2 and "\n" not in err
    assert "samples of model 'model' drawn from other weights" in err and "retrained" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_the_fingerprint_is_the_bytes_not_the_place(models, tmp_path):
    from sage_train.models.files import fingerprint

    shutil.copytree(models[0], tmp_path / "copy")
    (tmp_path / "copy" / "eval").mkdir()
    (tmp_path / "copy" / "eval" / "records.jsonl").write_text("{}\n")  # an --out inside the folder
    assert fingerprint(str(tmp_path / "copy"), skip=tmp_path / "copy" / "eval") == fingerprint(str(models[0]))
    assert fingerprint(str(models[0])) != fingerprint(str(models[1]))


def _broken(models, folder: Path, kind: str) -> Path:
    folder.mkdir()
    if kind == "empty":
        return folder
    for file in models[0].iterdir():
        shutil.copy(file, folder / file.name)
    if kind == "invalid-config":
        (folder / "config.json").write_text('{"model_type": "qwen2", ')
    elif kind == "truncated-weights":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif kind == "garbled-header":
        data = bytearray((folder / "model.safetensors").read_bytes())
        data[8:40] = b"\xff" * 32
        (folder / "model.safetensors").write_bytes(bytes(data))
    return folder


@pytest.mark.parametrize(
    "kind, words",
    [
        ("empty", "no config.json"),
        ("invalid-config", "config.json is not valid JSON"),
        ("truncated-weights", "model.safetensors is truncated"),
        ("garbled-header", "model.safetensors has a garbled header"),
    ],
)
def test_a_bad_model_directory_exits_2_with_one_line_and_writes_nothing(models, tmp_path, capsys, kind, words):
    folder = _broken(models, tmp_path / "model", kind)
    status, err = sage_eval(capsys, tmp_path / "eval", "--model", folder)
    assert status == 2 and err.startswith("sage-eval: --model 'model'") and words in err and "\n" not in err, err
    assert not (tmp_path / "eval").exists()


def test_a_bad_task_writes_nothing_and_the_corrected_command_runs(models, tmp_path, capsys):
    status = eval_main(["--model", str(models[0]), "--tasks", "no-such-task", "--out", str(tmp_path / "e")])
    assert status == 2 and "no-such-task" in capsys.readouterr().err and not (tmp_path / "e").exists()
    assert sage_eval(capsys, tmp_path / "e", "--model", models[0])[0] == 0


def _jsonl_task(path: Path, lines: list) -> str:
    path.write_bytes(b"".join(line if isinstance(line, bytes) else (line + "\n").encode() for line in lines))
    return str(path)


def test_an_overlong_prompt_is_refused_before_sampling(models, tmp_path, capsys):
    good = json.dumps({"problem": "1+1=", "answer": "2"})
    for size, cap in ((30 << 20, None), (400, "100")):  # 30 MB: refused unread; 400 characters: counted
        task = _jsonl_task(tmp_path / f"long{size}.jsonl", [good, json.dumps({"problem": "7" * size, "answer": "1"})])
        extra = ["--max-prompt-tokens", cap] if cap else []
        status = eval_main(
            [
                "--model",
                str(models[0]),
                "--tasks",
                task,
                "--n",
                "1",
                "--no-progress",
                "--out",
                str(tmp_path / f"e{size}"),
                *extra,
            ]
        )
        err = capsys.readouterr().err.strip()
        assert status == 2 and "problem" in err and "/1'" in err and "--max-prompt-tokens" in err, err
        assert not (tmp_path / f"e{size}").exists()


@pytest.mark.parametrize(
    "line, words",
    [
        ('["1+1=", "2"]', ["expected a JSON object", "list"]),
        ('{"problem": "1+1=", "answer": ', ["not valid JSON"]),
        (b'{"problem": "caf\xe9", "answer": "1"}\n', ["not UTF-8"]),
        ('{"problem": "1+1=", "answer": ["2"]}', ["the answer must be a string or a number", "list"]),
        ('{"question_text": "1+1=", "answer": "2"}', ["no 'problem'"]),
    ],
)
def test_a_bad_jsonl_row_names_the_file_and_line(models, tmp_path, capsys, line, words):
    good = json.dumps({"problem": "1+1=", "answer": "2"})
    task = _jsonl_task(tmp_path / "set.jsonl", [good, "", line])  # line 3, after a blank line
    status = eval_main(["--model", str(models[0]), "--tasks", task, "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err and f"{tmp_path / 'set.jsonl'}:3" in err, err
    assert all(word in err for word in words), err
    assert not (tmp_path / "e").exists()
