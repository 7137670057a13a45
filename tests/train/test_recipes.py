"""The packaged recipes parse and validate without loading a model, carry the official SAGE
hyperparameters, and reject unknown keys; their DeepSpeed configs merge."""

import pytest
import torch
import yaml

from sage_train.cli import train_main
from sage_train.config import ConfigError, parse_args
from sage_train.config_files import packaged_config_names, packaged_config_path
from sage_train.inputs import deepspeed_config, run_settings

QWEN_ALGORITHMS = [
    "grpo",
    "sage-branch",
    "sage-token",
    "sage-random",
    "bnpo",
    "dapo",
    "sage-branch-bnpo",
    "sage-branch-dapo",
]
R1_ALGORITHMS = ["grpo", "sage-branch", "sage-token", "sage-random"]
RECIPES = [f"qwen2.5-math-7b-sft-{a}" for a in QWEN_ALGORITHMS] + [f"r1-distill-qwen-7b-{a}" for a in R1_ALGORITHMS]

#: the official SAGE settings every recipe carries
OFFICIAL = {
    "steps": 1000,
    "steps_per_generation": 2,
    "lr": 5e-6,
    "lr_schedule": "constant",
    "weight_decay": 0.01,
    "max_grad_norm": 1.0,
    "lora_rank": 8,
    "lora_alpha": 16.0,
    "lora_dropout": 0.0,
    "eps_low": 0.2,
    "eps_high": 0.2,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.01,
    "stop": ["</SOLUTION>"],
    "system_prompt": "official",
    "task": "dapo-math",
    "task_options": {"template": "plain"},
    "tis_level": "token",
    "tis_cap": 2.0,
    "kl": "k3",
    "dynamic_sampling": False,
    "overlong_filter": False,
    "scale_rewards": True,
    "gamma": 0.3,
    "tau": 1.2,
    "q_min": 0.6,
    "q_max": 1.4,
    "guide_alpha_max": 0.3,
    "guide_alpha_min": 0.1,
    "guide_num_cycles": 8,
    "guide_decay_rate": 0.9,
    "guide_normalization": "minmax",
}
#: algorithm -> (loss_type, beta, guide), as in the paper's tables
ALGORITHMS = {
    "grpo": ("grpo", 0.05, "none"),
    "sage-branch": ("grpo", 0.05, "branch"),
    "sage-token": ("grpo", 0.05, "token"),
    "sage-random": ("grpo", 0.05, "random"),
    "bnpo": ("bnpo", 0.0, "none"),
    "dapo": ("dapo", 0.0, "none"),
    "sage-branch-bnpo": ("bnpo", 0.05, "branch"),
    "sage-branch-dapo": ("dapo", 0.05, "branch"),
}


def test_recipes_are_packaged():
    assert set(RECIPES) <= set(packaged_config_names())


def dry_run(name: str, capsys) -> dict:
    """The resolved config `sage-train --config NAME --dry-run` prints."""
    assert train_main(["--config", name, "--dry-run"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("name", RECIPES)
def test_dry_run_shows_the_official_values(name, capsys):
    cfg = dry_run(name, capsys)
    assert cfg["name"] == name
    assert {key: cfg[key] for key in OFFICIAL} == OFFICIAL
    algorithm = name.split("-7b-sft-")[-1] if name.startswith("qwen") else name.split("-7b-")[-1]
    assert cfg["algorithm"] == algorithm
    assert (cfg["loss_type"], cfg["beta"], cfg["guide"]) == ALGORITHMS[algorithm]
    sigma = {"token": (0.25, 0.1), "random": (0.15, 0.05)}.get(cfg["guide"], (0.25, 0.1))
    assert (cfg["guide_sigma_max"], cfg["guide_sigma_min"]) == sigma
    assert (cfg["guide_eps_max"], cfg["guide_eps_min"]) == (0.1, 0.0)
    assert cfg["prompts_per_step"] * cfg["group_size"] == 8 and cfg["group_size"] == 8  # completions per step
    assert cfg["rollout_engine"] == "vllm" and cfg["bf16"]
    lengths = (cfg["max_new_tokens"], cfg["max_prompt_length"], cfg["vllm_max_model_len"])
    if name.startswith("qwen2.5-math"):
        assert cfg["model"] == "Qwen/Qwen2.5-Math-7B" and cfg["chat_template"] == "official"
        sft = {
            key: cfg[key]
            for key in (
                "sft_task",
                "sft_format",
                "sft_epochs",
                "sft_batch_size",
                "sft_lr",
                "sft_lr_schedule",
                "sft_warmup_steps",
                "sft_weight_decay",
                "sft_adapter",
            )
        }
        assert sft == {
            "sft_task": "openmathreasoning-mini",
            "sft_format": "official",
            "sft_epochs": 2,
            "sft_batch_size": 1,
            "sft_lr": 2e-4,
            "sft_lr_schedule": "linear",
            "sft_warmup_steps": 5,
            "sft_weight_decay": 0.01,
            "sft_adapter": "continue",
        }
        assert lengths == (3072, 1024, 4096)  # chosen: the official lengths exceed the model's context
    else:
        assert cfg["model"] == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B" and cfg["chat_template"] == "tokenizer"
        assert cfg["sft_steps"] == 0 and cfg["sft_epochs"] == 0
        assert lengths == (6144, 2048, 8192)


def test_dry_run_takes_overrides_and_rejects_bad_keys(capsys):
    assert dry_run(RECIPES[0], capsys)["lr"] == 5e-6
    assert train_main(["--config", RECIPES[0], "--lr=1e-5", "--dry-run"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["lr"] == 1e-5
    assert train_main(["--config", RECIPES[0], "--dry-run", "--lora_rnk=8"]) == 2
    assert "lora_rnk" in capsys.readouterr().out


def test_recipes_split_over_processes_when_prompts_scale():
    for name in RECIPES:
        cfg = parse_args(["--config", name, "--prompts_per_step=8"])
        for world in (1, 8):
            assert (cfg.prompts_per_step // world * cfg.group_size) % cfg.micro_batch_size == 0


@pytest.mark.parametrize("stage, file", [(2, "ds-zero2"), (3, "ds-zero3")])
def test_recipe_with_each_zero_stage(stage, file):
    cfg = parse_args(["--config", RECIPES[1], f"--zero_stage={stage}", f"--deepspeed_config={file}"])
    config = deepspeed_config(run_settings(cfg).optim, world=8, accumulation=16, device=torch.device("cpu"))
    assert config["zero_optimization"]["stage"] == stage
    assert config["train_batch_size"] == cfg.micro_batch_size * 16 * 8


def test_recipe_with_unknown_key_fails(tmp_path):
    values = yaml.safe_load(packaged_config_path(RECIPES[0]).read_text())
    values["lora_rnk"] = 8
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(values))
    with pytest.raises(ConfigError, match="lora_rnk"):
        parse_args(["--config", str(path)])
    with pytest.raises(ConfigError, match="tis_level"):
        parse_args(["--config", RECIPES[0], "--tis_level=always"])
    with pytest.raises(ConfigError, match="openai_base_url"):
        parse_args(["--config", RECIPES[0], "--rollout_engine=openai"])
