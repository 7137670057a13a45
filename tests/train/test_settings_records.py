"""The trainer's options travel as frozen records beside their tables (`sage_train.records`), not as
the whole config: at most `MAX_WHOLE_CONFIG` functions of sage_train take a `TrainConfig` (the ones
that check, resolve or save the config as a whole, or pick the records out of it), no value the run
carries holds one, each record reads the config's keys of its field names, and `config_rules`
spells no choice list (issue 50's done-when rules)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from sage_train.config import FIELDS, build, resolve
from sage_train.context import RunContext, Settings
from sage_train.guide import GuideSettings
from sage_train.inputs import RunPlan, run_settings

ROOT = Path(__file__).resolve().parents[2]
MAX_WHOLE_CONFIG = 10


def whole_config_functions() -> list[str]:
    """'module:function' of every function of sage_train with a parameter that is the whole config:
    annotated `TrainConfig`, or named ``cfg`` (the name the house gives it)."""
    found = []
    for path in sorted((ROOT / "sage_train").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(
                    a.arg == "cfg" or "TrainConfig" in ast.unparse(a.annotation or ast.Constant("")) for a in arguments
                ):
                    found.append(f"{path.relative_to(ROOT).with_suffix('')}:{node.name}")
    return found


def test_few_functions_take_the_whole_config():
    found = whole_config_functions()
    assert len(found) <= MAX_WHOLE_CONFIG, f"{len(found)} functions take the whole config: {found}"
    # the config's own homes: its rules, its preset, its checks and run directory, the records' picker
    assert {"sage_train/config:resolve", "sage_train/inputs:check_inputs", "sage_train/records:settings_of"} <= set(
        found
    )


@pytest.mark.parametrize("record", [RunPlan, RunContext, Settings])
def test_no_value_the_run_carries_holds_the_config(record):
    types = {field.name: str(field.type) for field in dataclasses.fields(record)}  # as written in the source
    assert not [name for name, kind in types.items() if "TrainConfig" in kind]


def varied_config():
    """A config whose keys differ from their defaults wherever a valid value allows, so a record that
    read the wrong key would show it."""
    return resolve(
        build(
            {
                "seed": 7,
                "steps": 9,
                "group_size": 4,
                "prompts_per_step": 6,
                "micro_batch_size": 8,
                "temperature": 0.7,
                "top_p": 0.9,
                "eval_temperature": 0.6,
                "eval_max_new_tokens": 12,
                "tis_level": "token",
                "tis_cap": 3.5,
                "lr": 2e-4,
                "lr_schedule": "cosine",
                "warmup_steps": 3,
                "eval_samples": 4,
                "held_out_seed": 11,
                "save_every": 3,
                "keep_checkpoints": 5,
                "lora_rank": 4,
                "sft_steps": 5,
                "sft_lr_schedule": "linear",
                "log_every": 2,
                "report_project": "p",
                "guide_num_cycles": 3,
                "algorithm": "sage-token",
            }
        )
    )


def test_each_record_holds_the_values_of_the_keys_it_names():
    cfg = varied_config()
    settings = run_settings(cfg)
    for field in dataclasses.fields(Settings):
        record = getattr(settings, field.name)
        if field.name == "saved":
            assert record == cfg.to_dict()
            continue
        if field.name == "loss":
            assert record.gamma == cfg.gamma and record.temperature == cfg.temperature == 0.7
            continue
        prefix = "guide_" if isinstance(record, GuideSettings) else ""
        for name in (f.name for f in dataclasses.fields(record)):
            key = prefix + name
            assert key in FIELDS or key in ("run_dir",), f"{type(record).__name__}.{name} is no config key"
            assert getattr(record, name) == getattr(cfg, key), (type(record).__name__, name)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, dataclasses.fields(record)[0].name, None)
    assert settings.guide.num_cycles == 3 and settings.corrections.tis_cap == 3.5 and settings.run.guide == "token"
    assert settings.sft.warm_start and settings.run.run_dir == cfg.run_dir


def test_every_key_reaches_a_record_or_a_whole_config_check():
    """A key no record reads is read by a function that takes the whole config (the checks of
    `inputs.check_inputs`, the presets), or is the loss's (`LossConfig`)."""
    cfg = varied_config()
    settings = run_settings(cfg)
    read = {f"guide_{f.name}" for f in dataclasses.fields(GuideSettings)}
    for field in dataclasses.fields(Settings):
        if field.name not in ("saved", "loss", "guide"):
            read |= {f.name for f in dataclasses.fields(getattr(settings, field.name))}
    read |= {f.name for f in dataclasses.fields(settings.loss)}
    # read only where the config is checked or resolved as a whole
    checked_only = {"task_options", "train_problems", "gguf_file", "deepspeed_config"}
    unread = sorted(set(FIELDS) - read - checked_only - {"output_dir"})
    assert unread == [], unread
