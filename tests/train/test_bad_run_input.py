"""Bad input to sage-train, tried as a careless or hostile user would: every mistake exits 2 with one
line naming it, before anything on disk changes, also with ``--overwrite`` over a finished run.

YAML that is not plain data (aliases, duplicate keys, Python tags, syntax errors, non-UTF-8 text),
keys out of range (every number of `RunOptions` is checked), run names that leave ``output_dir``
(``..``, ``.``, a link), a fresh run over a previous run's logs, and a resume with a changed config
before the run's first checkpoint. The run directories here are made by hand: each refusal comes
before the run would read them."""

import dataclasses
import hashlib
import time
from pathlib import Path

import pytest
import torch
import yaml
from run_copies import TINY_RUN, write_entries

from sage_train.cli import train_main
from sage_train.config import ConfigError, RunOptions, build, parse_args, resolve
from sage_train.config_files import save_yaml


def snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(Path(folder).rglob("*"))
    }


def sage_train(capsys, *argv) -> tuple[int, list[str]]:
    status = train_main([str(a) for a in argv])
    out = capsys.readouterr().out
    return status, [line for line in out.splitlines() if line.startswith("sage-train:")]


@pytest.fixture
def finished_run(tmp_path) -> Path:
    """tmp_path/runs/done: what a finished run leaves (files of each kind), and a config file for it."""
    run = write_entries(
        tmp_path / "runs" / "done",
        (
            "checkpoints/step000002/mp_rank_00_model_states.pt",
            "final/model.safetensors",
            "sft/config.json",
            "eval/records.jsonl",
            "tensorboard/events",
            "metrics.jsonl",
            "summary.json",
        ),
    )
    save_yaml(
        resolve(build({**TINY_RUN, "output_dir": str(tmp_path / "runs"), "name": "done"})).to_dict(),
        run / "config.yaml",
    )
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_RUN))
    return run


# --- YAML: plain data only -----------------------------------------------------------------------------

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")
)


@pytest.mark.parametrize(
    "text, words",
    [
        (BOMB + "lr: 0.1\n", ["alias"]),
        ("lr: 0.1\nsteps: 3\nlr: 0.2\n", ["'lr'", "twice", "line 3"]),
        ("lr: !!python/object/apply:os.system ['touch /tmp/owned']\n", ["python/object/apply"]),
        ("steps: [3\n", ["invalid YAML", "line"]),
        (b"name: caf\xe9\n", ["not UTF-8"]),
        ("- steps\n- 3\n", ["mapping"]),
        ("seed: " + "7" * 5000 + "\n", ["line 1", "5000 characters", "more digits"]),
        ("task_options: " + "[" * 10_000 + "]" * 10_000 + "\n", ["line 1", "nested deeper than 100"]),
    ],
    ids=[
        "alias-bomb",
        "duplicate-key",
        "python-tag",
        "syntax-error",
        "latin-1",
        "not-a-mapping",
        "5000-digits",
        "deep",
    ],
)
def test_a_config_file_that_is_not_plain_data_exits_2_with_one_line(tmp_path, capsys, text, words):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    start = time.perf_counter()
    status, lines = sage_train(capsys, "--config", path, "--dry-run")
    assert time.perf_counter() - start < 1.0
    assert status == 2 and len(lines) == 1 and len(lines[0]) < 300, lines
    assert "bad.yaml" in lines[0] and all(word in lines[0] for word in words), lines[0]


@pytest.mark.parametrize(
    "arg",
    ["--stop=[", "--lr=*a", "--task_options={a: 1, a: 2}", "--seed=!!python/name:os.system", "--seed=" + "7" * 5000],
)
def test_a_bad_command_line_value_exits_2_with_one_line(capsys, arg):
    status, lines = sage_train(capsys, arg, "--dry-run")
    assert status == 2 and len(lines) == 1 and arg.split("=")[0] in lines[0], lines


def test_a_string_key_keeps_text_that_is_not_yaml():
    assert parse_args(["--name=[draft", "--system_prompt=a: b", "--chat_template=official"]).name == "[draft"


# --- every key checked, before anything is touched -------------------------------------------------------


def _numbers_of_run_options() -> list[str]:
    defaults = build({})
    return [f.name for f in dataclasses.fields(RunOptions) if type(getattr(defaults, f.name)) in (int, float)]


@pytest.mark.parametrize("key", _numbers_of_run_options())
def test_every_number_of_the_run_options_refuses_a_negative_value(key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        build({key: -1})


@pytest.mark.parametrize(
    "arg, words",
    [
        ("--weight_decay=-1", ["'weight_decay'", ">= 0"]),
        ("--tiny_heads=3", ["'tiny_heads'", "divisor", "tiny_hidden_size=32"]),
        ("--tiny_heads=32", ["'tiny_heads'", "even"]),  # head size 1: rotary embeddings rotate pairs
        ("--tiny_kv_heads=3", ["'tiny_kv_heads'", "tiny_heads=2"]),
        ("--tiny_max_positions=0", ["'tiny_max_positions'", "positive"]),
        ("--seed=-3", ["'seed'", ">= 0"]),
        ("--name=..", ["'name'", "inside output_dir"]),
        ("--name=.", ["'name'", "inside output_dir"]),
        ("--name=a/b", ["'name'"]),
        # what only a model meets: checked on its tokenizer and a weightless skeleton of it
        ("--lora_rank=4 --lora_target_modules=[q_proj,nope]", ["'lora_target_modules'", "['nope']", "k_proj"]),
        ("--chat_template=tokenizer", ["'chat_template'", "no chat template"]),
        ("--sft_steps=5 --sft_max_example_tokens=1", ["sft_max_example_tokens", "no example"]),
        ("--rollout_engine=vllm", ["'rollout_engine'", "vLLM"]),
        ("--hf_rollout_dtype=int8", ["'hf_rollout_dtype'", "'bfloat16'"]),
        ("--hf_rollout_dtype=bfloat16 --zero_stage=3", ["'hf_rollout_dtype'", "ZeRO-3"]),
    ],
)
def test_a_bad_key_with_overwrite_exits_2_and_the_finished_run_survives(finished_run, capsys, arg, words):
    if "vllm" in arg and torch.cuda.is_available():
        pytest.skip("this machine could run vLLM")
    root = finished_run.parents[1]
    before = snapshot(root)
    status, lines = sage_train(
        capsys,
        "--config",
        root / "tiny.yaml",
        f"--output_dir={root / 'runs'}",
        "--name=done",
        "--overwrite",
        *arg.split(),
    )
    assert status == 2 and len(lines) == 1, lines
    assert all(word in lines[0] for word in words), lines[0]
    assert snapshot(root) == before


def test_dot_dot_cannot_reach_the_folder_above_the_runs(tmp_path, capsys):
    """A user's project folder holding the runs folder, and files named like a run's outputs."""
    project, runs = tmp_path / "project", tmp_path / "project" / "runs"
    runs.mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "wandb/run.wandb"):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text("the user's own file\n")
    (runs / "elsewhere").symlink_to(tmp_path)
    before = snapshot(tmp_path)
    for name in ("..", ".", "elsewhere", "../project"):
        for extra in ([], ["--overwrite"]):
            status, lines = sage_train(capsys, f"--output_dir={runs}", f"--name={name}", "--steps=1", *extra)
            assert status == 2 and len(lines) == 1 and "'name'" in lines[0], (name, lines)
    assert snapshot(tmp_path) == before


def test_a_fresh_run_over_a_previous_runs_logs_is_refused(tmp_path, capsys):
    """No checkpoint, final or sft model: its metrics and logger files are still a previous run's."""
    run = tmp_path / "runs" / "logged"
    (run / "tensorboard").mkdir(parents=True)
    (run / "tensorboard" / "events").write_text("events\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_RUN))
    before = snapshot(tmp_path)
    status, lines = sage_train(
        capsys, "--config", tmp_path / "tiny.yaml", f"--output_dir={tmp_path / 'runs'}", "--name=logged"
    )
    assert status == 2 and len(lines) == 1, lines
    assert "metrics.jsonl" in lines[0] and "tensorboard/" in lines[0] and "--overwrite" in lines[0]
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("arg", ["--sft_steps=7", "--seed=5", "--lr=0.5", "--algorithm=grpo", "--task=countdown"])
def test_a_changed_config_is_refused_on_resume_before_the_first_checkpoint(tmp_path, capsys, arg):
    """Killed after its warm start was saved (sft/), before its first checkpoint: the resume would reuse
    that warm start, so every key but `RESUME_MAY_CHANGE` must be the one it was made with."""
    values = {**TINY_RUN, "sft_steps": 3, "task_options": {}}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(values))
    run = tmp_path / "runs" / "warm"
    (run / "sft").mkdir(parents=True)
    (run / "sft" / "config.json").write_text("{}\n")
    save_yaml(
        resolve(build({**values, "output_dir": str(tmp_path / "runs"), "name": "warm"})).to_dict(), run / "config.yaml"
    )
    before = snapshot(tmp_path)
    status, lines = sage_train(
        capsys, "--config", tmp_path / "tiny.yaml", f"--output_dir={tmp_path / 'runs'}", "--name=warm", "--resume", arg
    )
    assert status == 2 and len(lines) == 1, lines
    assert "differ from the run's saved config" in lines[0] and arg[2:].split("=")[0] in lines[0]
    assert snapshot(tmp_path) == before


def test_overwrite_clears_the_previous_runs_evaluations_too(finished_run, distributed):
    """sage-eval's default --out is <run>/eval: the new model must not inherit the old one's samples."""
    from sage_train.run_dir import discard_previous, prepare_run_dir

    cfg = resolve(build({**TINY_RUN, "output_dir": str(finished_run.parent), "name": "done", "overwrite": True}))
    prepare_run_dir(cfg, finished_run, 0, 1)
    # kept aside, out of the new run's way, until its first step has run
    assert sorted(p.name for p in finished_run.iterdir()) == [".previous_run", "config.yaml"]
    assert (finished_run / ".previous_run" / "eval").is_dir()
    discard_previous(finished_run)
    assert sorted(p.name for p in finished_run.iterdir()) == ["config.yaml"]
