"""``--overwrite`` loses nothing until the new run has proved it can run: the previous run is moved
aside whole (``.previous_run/``) and deleted only after the new run's model, tokenizer and chat
template have loaded and its first step has run. A model that fails anywhere before then (a defect
`check_model` does not see: a dtype safetensors does not know, a shape its data offsets contradict, a
config that disagrees with the weights, a NaN weight, no tokenizer files, a chat template the Jinja
sandbox refuses) ends in one line naming the model, with the previous run put back as it was; a
kill -9 at any point of the move leaves one run whole, which the next run in the directory puts
back (or finishes deleting). A sound model replacing a run: test_run_safety's overwrite test.

The kill tests drive the real moves in a forked process killed by SIGKILL at each phase
(`run_dir.KILL_AT_ENV`); one end-to-end kill of a real ``sage-train`` process is marked slow."""

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from run_copies import write_entries
from safetensors.torch import load_file, save_file
from tiny_models import tiny_model

from sage_train import run_dir as run_dir_module
from sage_train.cli import train_main
from sage_train.config import parse_args
from sage_train.models.files import ModelFilesError
from sage_train.models.loading import build_char_tokenizer, load_weights
from sage_train.run_dir import prepare_run_dir
from sage_train.run_files import RUN_FILES
from sage_train.safe_files import RunDirError

REPO = Path(__file__).resolve().parents[2]
#: a run of seconds on a model folder: one step of 1-digit addition
RUN = {
    "model": "tiny",
    "task": "arithmetic",
    "task_options": {"digits": 1},
    "train_problems": 16,
    "sft_steps": 0,
    "steps": 1,
    "prompts_per_step": 2,
    "group_size": 2,
    "micro_batch_size": 4,
    "max_new_tokens": 2,
    "eval_problems": 0,
    "chat_template": "",
    "progress": False,
    "plots": False,
    "report_to": [],
    "cpu_threads": 1,
}


def snapshot(folder: Path) -> dict:
    """Every entry under `folder` (files by content hash): what 'left as it was' means."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(Path(folder).rglob("*"))
    }


@pytest.fixture
def previous_run(tmp_path) -> Path:
    """tmp_path/runs/done: a finished run's entries (checkpoints, final model, sft, metrics, summary,
    evaluations, config), each with its own content, for the --overwrite runs to keep."""
    run = write_entries(
        tmp_path / "runs" / "done",
        (
            "checkpoints/step000001/mp_rank_00_model_states.pt",
            "checkpoints/latest",
            "final/model.safetensors",
            "sft/model.safetensors",
            "eval/records.jsonl",
            "metrics.jsonl",
            "summary.json",
            "config.yaml",
        ),
    )
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(RUN))
    return run


def model_folder(path: Path) -> Path:
    """A model a finished run saves as final/: a tiny Qwen2 and its character tokenizer."""
    tokenizer = build_char_tokenizer()
    tiny_model(tokenizer, layers=1, max_positions=64).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def overwrite(capsys, previous_run: Path, model: Path, *extra) -> tuple[int, list[str]]:
    root = previous_run.parents[1]
    argv = ["--config", str(root / "run.yaml"), f"--output_dir={root / 'runs'}", "--name=done", "--overwrite"]
    status = train_main([*argv, f"--model={model}", *extra])
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sage-train:")]
    return status, [line for line in said if "--overwrite: starting" not in line]  # that note, then the error


def rewrite_safetensors(file: Path, change) -> None:
    """`file` with its JSON header changed by change(header), its data as it was."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])


def first_matrix(header: dict) -> dict:
    return next(v for k, v in sorted(header.items()) if k != "__metadata__" and len(v["shape"]) == 2)


def unknown_dtype(folder: Path) -> None:
    rewrite_safetensors(folder / "model.safetensors", lambda h: first_matrix(h).update(dtype="F31"))


def offsets_against_shape(folder: Path) -> None:
    def halve(header):
        entry = first_matrix(header)
        entry["shape"] = [entry["shape"][0] // 2, entry["shape"][1]]

    rewrite_safetensors(folder / "model.safetensors", halve)


def transposed(folder: Path) -> None:
    def swap(header):
        entry = next(v for k, v in sorted(header.items()) if "up_proj" in k)
        entry["shape"] = entry["shape"][::-1]

    rewrite_safetensors(folder / "model.safetensors", swap)


def config_key(key: str, factor: int):
    def change(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config[key] *= factor
        (folder / "config.json").write_text(json.dumps(config))

    return change


def nan_weight(folder: Path) -> None:
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def missing_weight(folder: Path) -> None:
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def no_tokenizer_files(folder: Path) -> None:
    """The issue's reproduction: a finished run's final/ with its tokenizer files deleted."""
    for file in folder.iterdir():
        if file.name.startswith("tokenizer") or file.name == "special_tokens_map.json":
            file.unlink()


def sandbox_refuses_template(folder: Path) -> None:
    """A chat template that reaches for Python internals, which transformers' Jinja sandbox refuses
    when the first prompt is rendered (in the first step)."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages.__class__.__mro__ }}{{ messages[0]['content'] }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


#: a model defect, the words that say what is wrong, and the extra options of the run
DEFECTS = {
    "unknown safetensors dtype": (unknown_dtype, "F31", []),
    "data_offsets against the shape": (offsets_against_shape, "invalid shape, data type, or offset", []),
    "transposed matrix": (transposed, "another shape than its config.json gives: model.layers.0.mlp.up_proj", []),
    "config hidden_size": (config_key("hidden_size", 2), "another shape than its config.json gives", []),
    "config vocab_size": (
        config_key("vocab_size", 2),
        "lm_head.weight (the file's (128, 32), the config's (256, 32))",
        [],
    ),
    "NaN weight": (nan_weight, "down_proj.weight holds NaN", []),
    "missing weight": (missing_weight, "lacks weight(s) the model needs: model.layers.0.mlp.up_proj.weight", []),
    "no tokenizer files": (no_tokenizer_files, "tokenizer has no vocabulary", []),
    "template the sandbox refuses": (sandbox_refuses_template, "unsafe", ["--chat_template=tokenizer"]),
}


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_overwrite_with_a_defective_model_keeps_the_previous_run(tmp_path, capsys, previous_run, distributed, defect):
    damage, words, extra = DEFECTS[defect]
    model = model_folder(tmp_path / "m")
    damage(model)
    before = snapshot(previous_run)
    status, lines = overwrite(capsys, previous_run, model, *extra)
    assert status == 2 and len(lines) == 1, lines
    assert str(model) in lines[0] and "'model'" in lines[0] and words in lines[0], lines[0]
    assert snapshot(previous_run) == before


# --- kill -9 at each point of the move: one run whole, put right by the next run -----------------------


def new_run_entries(run_dir: Path) -> None:
    """What a new run writes before its first step ends (its config, metrics, a warm start)."""
    (run_dir / "config.yaml").write_text("the new run's config\n")
    (run_dir / "metrics.jsonl").write_text("")
    (run_dir / "sft").mkdir()
    (run_dir / "sft" / "model.safetensors").write_text("the new run's warm start\n")


def killed_at(phase: str, run_dir: Path, *, fails: bool) -> None:
    """The moves of an --overwrite run over `run_dir` (aside; the new run's entries; then put back
    when it `fails`, else deleted after its first step), in a forked process killed by SIGKILL at `phase`."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        try:
            os.environ[run_dir_module.KILL_AT_ENV] = phase
            run_dir_module.move_previous_aside(run_dir)
            new_run_entries(run_dir)
            if fails:
                run_dir_module.put_previous_back(run_dir)
            else:
                run_dir_module.discard_previous(run_dir)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"{phase} was not reached"


@pytest.mark.parametrize(
    "phase, fails",
    [("moving_aside", True), ("aside", True), ("putting_back", True), ("first_step", False), ("discarding", False)],
)
def test_a_kill_at_any_point_of_the_move_leaves_one_run_whole(previous_run, capsys, phase, fails):
    before = snapshot(previous_run)
    killed_at(phase, previous_run, fails=fails)
    assert snapshot(previous_run) != before  # the kill left the move half done
    run_dir_module.recover_previous_run(previous_run)
    if phase == "discarding":  # once the previous run is renamed to be deleted, the new run is the one kept
        assert sorted(p.name for p in previous_run.iterdir()) == ["config.yaml", "metrics.jsonl", "sft"]
        assert (previous_run / "sft" / "model.safetensors").read_text() == "the new run's warm start\n"
    else:
        assert snapshot(previous_run) == before
        assert "is put back" in capsys.readouterr().out


def test_a_link_in_place_of_the_kept_run_is_refused_never_followed(previous_run, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "final").mkdir(parents=True)
    (previous_run / RUN_FILES.previous_run).symlink_to(elsewhere)
    with pytest.raises(RunDirError, match="symbolic link"):
        run_dir_module.recover_previous_run(previous_run)
    assert (elsewhere / "final").is_dir() and not (previous_run / "final" / "model.safetensors").is_symlink()


@pytest.mark.slow
def test_kill_9_of_a_real_run_after_the_move_then_the_next_run_puts_the_previous_one_back(
    tmp_path, capsys, previous_run, distributed
):
    before = snapshot(previous_run)
    root = previous_run.parents[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), run_dir_module.KILL_AT_ENV: "aside"}
    env.pop("RANK", None)
    argv = ["--config", str(root / "run.yaml"), f"--output_dir={root / 'runs'}", "--name=done", "--overwrite"]
    model = model_folder(tmp_path / "m")
    done = subprocess.run([sys.executable, "-m", "sage_train", *argv, f"--model={model}"], env=env, cwd=REPO)
    assert done.returncode == -signal.SIGKILL
    assert sorted(os.listdir(previous_run)) == [RUN_FILES.previous_run, RUN_FILES.lock]  # killed holding the lock
    # the next run in the directory (here a fresh one, refused) puts the previous run back first
    status = train_main(["--config", str(root / "run.yaml"), f"--output_dir={root / 'runs'}", "--name=done"])
    out = capsys.readouterr().out
    assert status == 2 and "is put back" in out and "holds a previous run" in out, out
    assert snapshot(previous_run) == before


# --- item 4: a load report that lists missing or unexpected weights --------------------------------------


def test_missing_unexpected_or_no_weights_are_refused_naming_them_and_tied_ones_load(tmp_path):
    tokenizer = build_char_tokenizer()
    folder = model_folder(tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "mlp" not in k}, folder / "model.safetensors")
    with pytest.raises(ModelFilesError, match=r"lacks weight\(s\) the model needs: model.layers.0.mlp.down_proj"):
        load_weights(str(folder), tokenizer)
    save_file({**weights, "model.extra.weight": torch.ones(3)}, folder / "model.safetensors")
    with pytest.raises(ModelFilesError, match=r"does not have: model.extra.weight"):
        load_weights(str(folder), tokenizer)
    save_file({}, folder / "model.safetensors")
    with pytest.raises(ModelFilesError, match=r"model.embed_tokens.weight.* and \d+ more"):
        load_weights(str(folder), tokenizer)
    tied = tiny_model(tokenizer, layers=1, max_positions=64)
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    shutil.rmtree(folder)
    tied.save_pretrained(folder)
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")
    model = load_weights(str(folder), tokenizer)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.model.embed_tokens.weight, tied.model.embed_tokens.weight)


# --- item 8: an output_dir too long for the kernel; a key the resumed run's saved config lacks ------------


def test_an_output_dir_too_long_for_the_kernel_is_one_line_naming_it(tmp_path, capsys):
    long = tmp_path.joinpath(*["d" * 200] * 25)  # each name fits the filesystem; the path (5,000+ bytes) does not
    status = train_main([f"--output_dir={long}", "--steps=1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sage-train:")]
    assert status == 2 and len(lines) == 1 and "'output_dir'" in lines[0] and "3584 bytes" in lines[0], lines
    assert len(lines[0]) < 300 and not (tmp_path / ("d" * 200)).exists()


def test_resume_compares_a_key_the_saved_config_lacks_with_the_default_it_had(tmp_path, capsys, distributed):
    """A run saved by a version without ``kl_clamp`` ran with its default (None: no clamp)."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(RUN))
    argv = ["--config", str(tmp_path / "run.yaml"), f"--output_dir={tmp_path / 'runs'}", "--name=old", "--resume"]
    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    saved = parse_args(argv).to_dict()
    assert saved.pop("kl_clamp") is None
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    before = snapshot(run)
    assert train_main([*argv, "--kl_clamp=3"]) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sage-train:")]
    assert len(lines) == 1 and "['kl_clamp']" in lines[0] and "None (absent: its default) -> 3.0" in lines[0], lines
    assert snapshot(run) == before
    cfg = parse_args([*argv, "--kl_clamp=null"])  # the value it had: the run continues
    assert prepare_run_dir(cfg, cfg.run_dir, 0, 1) == ([], [])
