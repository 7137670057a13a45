"""TrainConfig: YAML + --key=value, type checks, unknown keys, presets."""

import dataclasses

import pytest

from sage_train.config import ConfigError, TrainConfig, build, parse_args, resolve
from sage_train.config_files import packaged_config_names
from sage_train.inputs import check_inputs
from sage_train.presets import PRESETS, loss_config


def test_packaged_default_loads_and_resolves_to_sage_branch():
    cfg = parse_args([])
    assert cfg.algorithm == "sage-branch" and cfg.guide == "branch" and cfg.beta == 0.05 and cfg.kl == "k3"
    assert cfg.model == "tiny" and cfg.sft_steps > 0
    assert {"tiny-cpu", "ds-zero2", "ds-zero3"} <= set(packaged_config_names())


def test_command_line_overrides_win_and_are_typed(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 7\nlr: 0.01\nname: from-file\n")
    cfg = parse_args(
        ["--config", str(path), "--lr=2e-4", "--stop", '["\\n"]', "--name=123", "--resume", "--local_rank=1"]
    )
    assert (cfg.steps, cfg.lr, cfg.stop, cfg.name, cfg.resume) == (7, 2e-4, ["\n"], "123", True)
    assert isinstance(cfg.lr, float)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--stpes=3"], ["unknown", "stpes"]),
        (["--steps=three"], ["steps", "int", "three"]),
        (["--lr=fast"], ["lr", "float"]),
        (["--resume=maybe"], ["resume", "bool"]),
        (["--task_options=5"], ["task_options", "dict"]),
        (["--steps=0"], ["steps", "positive"]),
        (["--group_size=1"], ["group_size", "at least 2"]),
        (["--algorithm=ppo"], ["algorithm", "grpo", "dapo"]),
        (["--guide=fork"], ["guide", "branch"]),
        (["--kl=k9"], ["kl", "k3"]),
        (["--eps_low=1.5"], ["eps_low"]),
        (["--zero_stage=4"], ["zero_stage"]),
        (["--config", "no-such-config"], ["no-such-config", "tiny-cpu"]),
        (["steps=3"], ["unexpected argument"]),
    ],
)
def test_bad_configs_fail_naming_the_key(argv, words):
    with pytest.raises(ConfigError) as error:
        parse_args(argv)
    for word in words:
        assert word in str(error.value)


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("steps: 3\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="learning_rate.*bad.yaml"):
        parse_args(["--config", str(path)])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_resolves_to_valid_loss_options(name):
    cfg = resolve(build({"algorithm": name}))
    assert all(
        getattr(cfg, key) is not None
        for key in (
            "beta",
            "kl",
            "guide",
            "loss_type",
            "eps_high",
            "dynamic_sampling",
            "overlong_filter",
            "scale_rewards",
        )
    )
    loss_config(cfg)


def test_preset_values_and_explicit_keys_winning():
    full = resolve(build({"algorithm": "dapo-full"}))
    assert (full.beta, full.loss_type, full.eps_high, full.dynamic_sampling, full.overlong_filter) == (
        0.0,
        "dapo",
        0.28,
        True,
        True,
    )
    assert resolve(build({"algorithm": "dapo-full", "eps_high": 0.3})).eps_high == 0.3
    assert resolve(build({"algorithm": "dr_grpo"})).scale_rewards is False
    assert resolve(build({"algorithm": "grpo-no-kl"})).beta == 0.0
    assert loss_config(resolve(build({"algorithm": "sage-token"}))).guide == "none"  # log_q comes from outside


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_paper_baselines_change_only_the_loss_type_and_the_anchor(loss_type):
    """ "BNPO / DAPO (no KL)" are GRPO with another loss_type and beta 0; "+ Branch" the same
    loss_type with beta 0.05 and the branch guide; nothing else differs from grpo."""
    grpo = resolve(build({"algorithm": "grpo"})).to_dict()
    no_kl = resolve(build({"algorithm": loss_type})).to_dict()
    branch = resolve(build({"algorithm": f"sage-branch-{loss_type}"})).to_dict()
    changed = lambda cfg: {k: v for k, v in cfg.items() if grpo[k] != v and k != "algorithm"}  # noqa: E731
    assert changed(no_kl) == {"loss_type": loss_type, "beta": 0.0}
    assert changed(branch) == {"loss_type": loss_type, "guide": "branch"}
    assert branch["beta"] == 0.05


def test_guide_schedule_keys_default_to_the_official_values():
    token = resolve(build({"algorithm": "sage-token"}))
    random = resolve(build({"algorithm": "sage-random"}))
    assert (token.guide_alpha_max, token.guide_alpha_min, token.guide_sigma_max, token.guide_sigma_min) == (
        0.3,
        0.1,
        0.25,
        0.1,
    )
    assert (random.guide_eps_max, random.guide_eps_min, random.guide_sigma_max, random.guide_sigma_min) == (
        0.1,
        0.0,
        0.15,
        0.05,
    )
    assert (token.guide_num_cycles, token.guide_decay_rate, token.guide_normalization) == (8, 0.9, "minmax")
    assert resolve(build({"algorithm": "grpo", "guide": "random"})).guide_sigma_max == 0.15
    with pytest.raises(ConfigError, match="'guide_normalization'"):
        resolve(build({"algorithm": "sage-token", "guide_normalization": "softmax"}))
    with pytest.raises(ConfigError, match="'guide_alpha_max'"):
        resolve(build({"algorithm": "sage-token", "guide_alpha_max": 0.05}))


def test_forward_kl_preset_uses_the_forward_estimator():
    cfg = resolve(build({"algorithm": "grpo-forward-kl"}))
    assert (cfg.kl, cfg.guide, cfg.beta) == ("fk3", "none", 0.05)


def test_resolved_config_round_trips_through_yaml(tmp_path):
    from sage_train.config import load_yaml
    from sage_train.config_files import save_yaml

    cfg = parse_args(["--algorithm=sage-random", "--task_options={digits: 3}"])
    save_yaml(cfg.to_dict(), tmp_path / "c.yaml")
    assert load_yaml(tmp_path / "c.yaml") == cfg
    assert isinstance(cfg, TrainConfig)


@pytest.mark.parametrize("stage", [2, 3])
def test_packaged_deepspeed_files_merge_and_must_agree_with_zero_stage(stage):
    import torch

    from sage_train.inputs import deepspeed_config, run_settings

    cfg = resolve(build({"zero_stage": stage, "deepspeed_config": f"ds-zero{stage}"}))
    merged = deepspeed_config(run_settings(cfg).optim, world=2, accumulation=4, device=torch.device("cpu"))
    assert merged["zero_optimization"]["stage"] == stage and merged["zero_optimization"]["overlap_comm"]
    assert merged["train_batch_size"] == cfg.micro_batch_size * 4 * 2
    with pytest.raises(ConfigError, match="zero_stage"):
        deepspeed_config(
            run_settings(resolve(build({"zero_stage": 0, "deepspeed_config": f"ds-zero{stage}"}))).optim,
            world=1,
            accumulation=1,
            device=torch.device("cpu"),
        )


def test_main_reports_config_errors_and_help(capsys):
    from sage_train.cli import train_main as main

    assert main(["--stpes=3"]) == 2
    assert "stpes" in capsys.readouterr().out
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: sage-train" in out and "--sft_target_loss=" in out and "tiny-cpu" in out


def test_train_problems_beyond_the_default_pool_draws_a_larger_pool_with_the_default_as_its_prefix():
    default = check_inputs(parse_args(["--train_problems=0"]), world=1)
    larger = check_inputs(parse_args(["--train_problems=2500"]), world=1)
    smaller = check_inputs(parse_args(["--train_problems=100"]), world=1)
    assert len(default.train_problems) == 1000 and len(larger.train_problems) == 2500
    assert len({p.id for p in larger.train_problems}) == 2500
    assert [p.id for p in larger.train_problems[:1000]] == [p.id for p in default.train_problems]
    # the warm start sees the pool the prompts come from (an example per problem), never less than the default one
    assert len(larger.sft_examples) == 2500 and larger.sft_examples[:1000] == default.sft_examples
    assert smaller.sft_examples == default.sft_examples
    assert [p.id for p in smaller.train_problems] == [p.id for p in default.train_problems[:100]]


def test_the_guide_keys_are_the_guide_settings_fields_and_read_back_through_them():
    from sage_train.config import FIELDS
    from sage_train.guide import GUIDE_KEYS, GuideSettings, is_scheduled
    from sage_train.records import settings_of

    assert set(GUIDE_KEYS) <= set(FIELDS) and len(GUIDE_KEYS) == len(dataclasses.fields(GuideSettings))
    cfg = resolve(build({"algorithm": "sage-random", "guide_eps_max": 0.2, "guide_num_cycles": 3}))
    settings = settings_of(GuideSettings, cfg, "guide_")
    assert (settings.eps_max, settings.num_cycles, settings.sigma_max) == (0.2, 3, 0.15)  # the random guide's sigma
    assert [is_scheduled(g) for g in ("none", "branch", "token", "random")] == [False, False, True, True]


# --- every option read by its declared type, on the command line and in a file (issue 46 item 6) ---------

#: what YAML 1.1 reads as another type: a bool, an integer (digit groups, hex, octal, sexagesimal), a date
YAML_11_QUIRKS = [
    "yes",
    "no",
    "on",
    "off",
    "1_000",
    "2_3",
    "0x1f",
    "0o17",
    "010",
    "1:30",
    "2024-01-01",
    "1e-3",
    "12",
    "1.5",
]


def _parse(tmp_path, where: str, key: str, text: str):
    """parse_args of ``key: text`` given on the command line or in a config file."""
    rejection = key == "rollout_rs_threshold"  # it takes effect with a rejection option
    if where == "command line":
        return parse_args([f"--{key}={text}"] + ["--rollout_rs=token_k1"] * rejection)
    path = tmp_path / "run.yaml"
    path.write_text(f"{key}: {text}\n" + "rollout_rs: token_k1\n" * rejection)
    return parse_args(["--config", str(path)])


@pytest.mark.parametrize("where", ["command line", "config file"])
@pytest.mark.parametrize("text", YAML_11_QUIRKS)
def test_a_string_option_keeps_the_text_as_written(tmp_path, where, text):
    cfg = _parse(tmp_path, where, "name", text)
    assert cfg.name == text and type(cfg.name) is str


@pytest.mark.parametrize("where", ["command line", "config file"])
@pytest.mark.parametrize(
    "key, text",
    [("steps", t) for t in ("1_000", "2_3", "0x1f", "0o17", "010", "1:30", "0b11")]
    + [("lr", t) for t in ("1_0.5", "0.000_1", "1:30", "010")]
    + [("beta", "0_1")]
    + [(k, t) for k in ("resume", "bf16") for t in ("yes", "no", "on", "off")],
)
def test_a_number_or_boolean_option_refuses_what_yaml_11_reads_otherwise(tmp_path, where, key, text):
    with pytest.raises(ConfigError) as error:
        _parse(tmp_path, where, key, text)
    message = str(error.value)
    assert f"'{key}'" in message and repr(text) in message, message
    assert ("true or false" if key in ("resume", "bf16") else "plain decimal digits") in message, message


@pytest.mark.parametrize("where", ["command line", "config file"])
@pytest.mark.parametrize("key, text, value", [("steps", "1000", 1000), ("lr", "1e-3", 1e-3), ("resume", "true", True)])
def test_plain_numbers_and_booleans_still_read(tmp_path, where, key, text, value):
    assert getattr(_parse(tmp_path, where, key, text), key) == value


@pytest.mark.parametrize("where", ["command line", "config file"])
def test_rollout_rs_threshold_2_3_is_the_pair_2_and_3_not_23(tmp_path, where):
    import math

    from sage_train.rl_maths import parse_rejection

    cfg = _parse(tmp_path, where, "rollout_rs_threshold", "2_3")
    assert cfg.rollout_rs_threshold == "2_3"
    assert parse_rejection(cfg.rollout_rs, cfg.rollout_rs_threshold) == [("token_k1", math.log(2), math.log(3))]


@pytest.mark.parametrize("text", ["!!int 1_000", "!!int 0x10", "!!float 1_0.5"])
def test_an_explicit_tag_does_not_bring_back_yaml_11_numbers(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(f"steps: {text}\n")
    with pytest.raises(ConfigError, match="run.yaml.*line 1.*plain decimal digits"):
        parse_args(["--config", str(path)])


def test_quirky_strings_round_trip_through_the_saved_config_for_both_yaml_readers(tmp_path):
    import yaml

    from sage_train.config import load_yaml
    from sage_train.config_files import save_yaml

    for text in YAML_11_QUIRKS + ["0.5_2.0", "true", "null", "12", ".inf"]:
        cfg = parse_args([f"--name={text}", "--rollout_rs=token_k1", "--rollout_rs_threshold=2_3"])
        save_yaml(cfg.to_dict(), tmp_path / "c.yaml")
        assert load_yaml(tmp_path / "c.yaml") == cfg, text
        assert yaml.safe_load((tmp_path / "c.yaml").read_text())["name"] == text  # what sage-study reads back


def test_a_study_passes_training_overrides_by_their_type(tmp_path):
    """sage-study's --key=value overrides are read as sage-train reads them (YAML 1.1 made 2_3 the
    integer 23 there too), and its logged command line reproduces them."""
    from sage_train.study.design import StudyError, parse_study

    argv = ["--algorithms", "grpo", "--seeds", "0", "--out", str(tmp_path / "out")]
    study = parse_study([*argv, "--rollout_rs=token_k1", "--rollout_rs_threshold=2_3", "--report_project=on"])
    cfg = study.train_config_of(None, 0)
    assert (cfg.rollout_rs_threshold, cfg.report_project) == ("2_3", "on")
    assert "--rollout_rs_threshold=2_3" in study.train_command(None, 0)
    with pytest.raises(StudyError, match="'max_new_tokens'.*plain decimal digits"):
        parse_study([*argv, "--max_new_tokens=1_0"])


@pytest.mark.parametrize("value", ["1_000", "0x10", "١٢"])
def test_the_study_and_eval_flags_take_numbers_in_plain_decimal_digits_only(tmp_path, value):
    """Python's int() and float() read "1_000" (and Arabic-Indic digits): argparse's type=int did too."""
    from sage_train.eval.settings import build_parser, parse_ints
    from sage_train.study.design import StudyError, parse_study

    argv = ["--algorithms", "grpo", "--out", str(tmp_path / "out")]
    for flag in ("--steps", "--jobs", "--eval-n", "--seeds"):
        with pytest.raises(StudyError, match="plain decimal digits|comma-separated integers"):
            parse_study([*argv, flag, value] + ["--seeds", "0"] * (flag != "--seeds"))
    for flag in ("--n", "--limit", "--top-k", "--temperature", "--top-p"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--model", "m", "--tasks", "math500", flag, value])
    with pytest.raises(ValueError, match="--seeds"):
        parse_ints(f"0,{value}", "--seeds")
    assert build_parser().parse_args(["--model", "m", "--tasks", "x", "--n", "16", "--temperature", ".3"]).n == 16


def choice_tables() -> dict[str, set]:
    """The names of every table a config choice is read from, by where the table lives."""
    from sage_kernels.backends import BACKEND_CHOICES
    from sage_kernels.guides import GUIDES
    from sage_kernels.loss_types import LOSS_TYPES
    from sage_train.eval.evaluate import EVAL_SPLITS
    from sage_train.optim import LR_SCHEDULES, ZERO_STAGES
    from sage_train.report import LOGGERS
    from sage_train.rl_maths import IS_MODES, TIS_LEVELS
    from sage_train.rollout.base import ENGINES, HF_ROLLOUT_DTYPES
    from sage_train.sft import SFT_ADAPTERS, SFT_FORMATS, SFT_LR_SCHEDULES
    from sage_train.tasks.chat import CHAT_TEMPLATES

    tables = {
        "rollout.base.ENGINES": ENGINES,
        "rl_maths.TIS_LEVELS": TIS_LEVELS,
        "rl_maths.IS_MODES": IS_MODES,
        "backends.BACKEND_CHOICES": BACKEND_CHOICES,
        "report.LOGGERS": LOGGERS,
        "guides.GUIDES": GUIDES,
        "loss_types.LOSS_TYPES": LOSS_TYPES,
        "presets.PRESETS": PRESETS,
        "tasks.chat.CHAT_TEMPLATES": CHAT_TEMPLATES,
        "optim.LR_SCHEDULES": LR_SCHEDULES,
        "optim.ZERO_STAGES": ZERO_STAGES,
        "sft.SFT_FORMATS": SFT_FORMATS,
        "sft.SFT_ADAPTERS": SFT_ADAPTERS,
        "sft.SFT_LR_SCHEDULES": SFT_LR_SCHEDULES,
        "rollout.base.HF_ROLLOUT_DTYPES": HF_ROLLOUT_DTYPES,
        "eval.evaluate.EVAL_SPLITS": EVAL_SPLITS,
    }
    return {where: set(names) for where, names in tables.items()}


def test_config_rules_spell_no_tables_names():
    """`config_rules` reads each choice list from the table that defines it: no list, tuple or set
    literal of its source is made of a table's names (all of them or some, besides ""), so a new engine,
    correction, backend or logger is one entry in its table."""
    import ast
    from pathlib import Path

    import sage_train.config_rules as rules

    tables = choice_tables()
    found = []
    for node in ast.walk(ast.parse(Path(rules.__file__).read_text())):
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and node.elts:
            if all(isinstance(e, ast.Constant) and isinstance(e.value, (str, int)) for e in node.elts):
                names = {e.value for e in node.elts} - {""}  # "": a key's "none", in no table
                found += [f"line {node.lineno}: {sorted(names)} re-spells {t}" for t, n in tables.items() if names <= n]
    assert not found, found


def test_config_choices_are_the_tables():
    """The choices each key is checked against are the table's names in its order (the order the
    error message lists them in)."""
    from sage_train.config_rules import CHOICES

    tables = choice_tables()
    assert CHOICES["rollout_engine"] == ("hf", "vllm", "openai")
    assert set(CHOICES["rollout_engine"]) == tables["rollout.base.ENGINES"]
    assert CHOICES["tis_level"] == ("token", "sequence", "off")
    assert CHOICES["vllm_importance_sampling_mode"][0] == "off"
    assert set(CHOICES["vllm_importance_sampling_mode"]) == tables["rl_maths.IS_MODES"]
    assert CHOICES["loss_backend"] == ("auto", "reference", "cpu", "triton")
    assert CHOICES["chat_template"] == ("", "tokenizer", "official")
    # the choices that were literal lists until their tables existed: the same values, the same order
    assert CHOICES["zero_stage"] == (0, 1, 2, 3) and CHOICES["lr_schedule"] == ("constant", "cosine", "linear")
    assert CHOICES["sft_adapter"] == ("merge", "continue") and CHOICES["sft_lr_schedule"] == ("cosine", "linear")
    assert CHOICES["sft_format"] == ("raw", "official")
    assert CHOICES["hf_rollout_dtype"] == ("", "bfloat16", "float16", "float32")
    with pytest.raises(ConfigError, match="config key 'eval_splits' must be a list of 'train' and/or 'test'"):
        build({"eval_splits": ["train", "valid"]})
    with pytest.raises(ConfigError) as error:
        build({"report_to": ["tensorboard", "mlflow"]})
    assert str(error.value).startswith(
        "config key 'report_to' must be a list of 'tensorboard', 'wandb', 'trackio', got"
    )
