"""The packaged recipes parse and validate without loading a model, carry the official SAGE
hyperparameters, and reject unknown keys; their DeepSpeed configs merge."""

import pytest
import torch
import yaml

from sage_train.config import ConfigError, packaged_config_names, packaged_config_path, parse_args
from sage_train.build import deepspeed_config

RECIPES = [
    "qwen2.5-math-7b-sft-grpo",
    "qwen2.5-math-7b-sft-sage-branch",
    "r1-distill-qwen-7b-grpo",
    "r1-distill-qwen-7b-sage-branch",
]


def test_recipes_are_packaged():
    assert set(RECIPES) <= set(packaged_config_names())


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_parses_with_official_hyperparameters(name):
    cfg = parse_args(["--config", name])
    assert cfg.name == name
    assert cfg.algorithm == ("sage-branch" if name.endswith("sage-branch") else "grpo")
    assert cfg.guide == ("branch" if cfg.algorithm == "sage-branch" else "none")
    assert (cfg.lr, cfg.lr_schedule, cfg.group_size) == (5e-6, "constant", 8)
    assert (cfg.beta, cfg.eps_low, cfg.eps_high) == (0.05, 0.2, 0.2)
    assert (cfg.temperature, cfg.min_p, cfg.lora_rank) == (1.0, 0.01, 8)
    assert cfg.rollout_engine == "vllm" and cfg.bf16
    if name.startswith("qwen2.5-math"):
        assert (
            cfg.model == "Qwen/Qwen2.5-Math-7B"
            and cfg.sft_steps > 0
            and cfg.sft_task == "openmathreasoning-mini"
        )
    else:
        assert cfg.model == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B" and cfg.sft_steps == 0
    assert cfg.task == "dapo-math"
    for world in (1, 8, 16):
        assert cfg.prompts_per_step % world == 0
        assert (cfg.prompts_per_step // world * cfg.group_size) % cfg.micro_batch_size == 0


@pytest.mark.parametrize("stage, file", [(2, "ds-zero2"), (3, "ds-zero3")])
def test_recipe_with_each_zero_stage(stage, file):
    cfg = parse_args(["--config", RECIPES[1], f"--zero_stage={stage}", f"--deepspeed_config={file}"])
    config = deepspeed_config(cfg, world=8, accumulation=16, device=torch.device("cpu"))
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
