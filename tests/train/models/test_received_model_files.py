"""A model someone sent is data, tried as a hostile sender would: custom code named by its config
(with a "y" typed at transformers' prompt), a pickled weight file that would run code, a broken
tokenizer.json, a crafted or unreadable GGUF file. sage-train and sage-eval refuse each in one line,
run nothing, and (``--overwrite``) leave the previous run as it was: the model is read before the run
directory is touched."""

import builtins
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from run_copies import TINY_RUN
from tiny_gguf import write_tiny_gguf
from tiny_models import tiny_model

from sage_train.cli import eval_main, train_main
from sage_train.config import build, parse_args, resolve
from sage_train.config_files import save_yaml
from sage_train.inputs import check_inputs
from sage_train.models import loading
from sage_train.models.loading import build_char_tokenizer

CUSTOM_CODE = """from pathlib import Path

Path(__file__).with_name("the-folders-code-ran").write_text("ran")

from transformers import Qwen2Config, Qwen2ForCausalLM


class CustomConfig(Qwen2Config):
    model_type = "sage-custom"


class CustomModel(Qwen2ForCausalLM):
    config_class = CustomConfig
"""


class Evil:
    """Unpickled, it would create a file: what a crafted pytorch_model.bin could do instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(Path(folder).rglob("*"))
    }


def model_folder(path: Path) -> Path:
    tokenizer = build_char_tokenizer()
    tiny_model(tokenizer, layers=1, max_positions=64).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def with_custom_code(folder: Path) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "sage-custom", "architectures": ["CustomModel"]}
    config["auto_map"] = {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom.py").write_text(CUSTOM_CODE)
    return folder / "the-folders-code-ran"


def with_pickled_weights(folder: Path) -> Path:
    marker = folder / "the-pickle-ran"
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2), "extra": Evil(marker)}, folder / "pytorch_model.bin")
    return marker


def with_broken_tokenizer(folder: Path) -> Path:
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": 7}}')
    return folder / "nothing-runs-here"


DAMAGES = {
    "custom code": (with_custom_code, "without running code from the folder"),
    "pickled weights": (with_pickled_weights, "could run code"),
    "broken tokenizer.json": (with_broken_tokenizer, "tokenizer.json is not a tokenizer"),
}


@pytest.fixture
def answer_yes(monkeypatch) -> list:
    """transformers' "Do you wish to run the custom code? [y/N]" answered "y"; the prompts are kept."""
    asked = []

    def yes(prompt=""):
        asked.append(prompt)
        return "y"

    monkeypatch.setattr(builtins, "input", yes)
    return asked


@pytest.fixture
def previous_run(tmp_path) -> Path:
    """tmp_path/runs/done: a finished run's outputs, for the --overwrite runs to leave alone."""
    run = tmp_path / "runs" / "done"
    for name in ("checkpoints/step000002/mp_rank_00_model_states.pt", "final/model.safetensors", "metrics.jsonl"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(f"{name} of the finished run\n")
    save_yaml(
        resolve(build({**TINY_RUN, "output_dir": str(tmp_path / "runs"), "name": "done"})).to_dict(),
        run / "config.yaml",
    )
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_RUN))
    return run


def overwrite_with_model(capsys, previous_run: Path, model: str) -> list[str]:
    root = previous_run.parents[1]
    argv = ["--config", str(root / "tiny.yaml"), f"--output_dir={root / 'runs'}", "--name=done", "--overwrite"]
    assert train_main([*argv, f"--model={model}"]) == 2
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("sage-train:")]


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_received_model_is_refused_in_one_line_and_runs_nothing(tmp_path, capsys, answer_yes, previous_run, damage):
    make, words = DAMAGES[damage]
    folder = model_folder(tmp_path / "model")
    ran = make(folder)
    before = snapshot(previous_run)
    lines = overwrite_with_model(capsys, previous_run, str(folder))
    assert len(lines) == 1 and words in lines[0], lines
    assert snapshot(previous_run) == before
    status = eval_main(["--model", str(folder), "--tasks", "arithmetic", "--out", str(tmp_path / "eval")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sage-eval:")]
    assert status == 2 and len(err) == 1 and words in err[0], err
    assert not ran.exists() and not answer_yes
    assert not (tmp_path / "eval").exists()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(loading.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def crafted_ggufs(folder: Path) -> dict:
    """GGUF files a careless or hostile sender makes: cut short, random bytes, a valid header over
    garbage, a valid file whose tensor count was raised."""
    whole = folder / "whole.gguf"
    write_tiny_gguf(whole)
    data = whole.read_bytes()
    files = {
        "truncated": data[: len(data) // 3],
        "random": os.urandom(4096),
        "header-only": data[:24] + os.urandom(4096),
        "tensor-count": data[:8] + (10**6).to_bytes(8, "little") + data[16:],
    }
    for name, content in files.items():
        (folder / f"{name}.gguf").write_bytes(content)
    return {name: folder / f"{name}.gguf" for name in files}


def test_overwrite_with_an_unreadable_gguf_keeps_the_previous_run(tmp_path, capsys, cache, previous_run, monkeypatch):
    """The GGUF file is read (converted into the cache) before the run directory is touched."""
    before = snapshot(previous_run)
    for name, path in crafted_ggufs(tmp_path).items():
        lines = overwrite_with_model(capsys, previous_run, str(path))
        assert len(lines) == 1 and "not a GGUF model transformers can read" in lines[0], (name, lines)
        assert snapshot(previous_run) == before, name
    real_find_spec = loading.importlib.util.find_spec
    monkeypatch.setattr(
        loading.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gguf" else real_find_spec(name, *a),
    )
    lines = overwrite_with_model(capsys, previous_run, str(tmp_path / "whole.gguf"))
    assert len(lines) == 1 and "needs the 'gguf' package" in lines[0], lines
    assert snapshot(previous_run) == before


def test_a_gguf_model_is_read_and_checked_before_the_run_starts(tmp_path, cache, previous_run):
    """check_inputs converts it and checks what the model meets (the LoRA target modules of the real
    model recipe on its skeleton, its chat template), as for a model directory, writing nothing."""
    write_tiny_gguf(tmp_path / "tiny.gguf")
    cfg = parse_args([f"--model={tmp_path / 'tiny.gguf'}", f"--output_dir={tmp_path / 'runs'}", "--name=new"])
    check_inputs(cfg, world=1)
    assert any((folder / "config.json").is_file() for folder in cache.iterdir())
    assert not (tmp_path / "runs" / "new").exists()
