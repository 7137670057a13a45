"""What a run is built from: the DeepSpeed engine and optimiser of the policy, the reference
scorer, the rollout engine, the learning-rate schedule and the guide computed outside the loss."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from sage_kernels.guides import BranchGuide, Guide, RandomGuide, TokenGuide

from .config import ConfigError, TrainConfig
from .lora import AdapterDisabled, apply_lora, base_lm, is_lora, merged_named_weights
from .lr_schedule import lr_schedule
from .packaged_models import model_directory
from .policy import PolicyHead
from .rollout import make_engine


def build_engines(cfg: TrainConfig, model, reference_lm, world: int, device: torch.device):
    """The DeepSpeed engine of the policy and the reference scorer (ZeRO-3-partitioned under stage 3)."""
    import deepspeed

    local_rows = check_batch_shape(cfg, world)
    # DeepSpeed's nominal accumulation: the update marks its last micro-batch itself (a token budget varies their count)
    ds_config = deepspeed_config(cfg, world, max(1, local_rows // cfg.micro_batch_size), device)
    policy = PolicyHead(model.to(device), cfg.loss_backend, cfg.gradient_checkpointing)
    trainable = [p for p in policy.parameters() if p.requires_grad]  # the adapter only under LoRA
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    total = cfg.steps * cfg.num_iterations
    engine, *_ = deepspeed.initialize(
        model=policy,
        optimizer=optimizer,
        config=ds_config,
        lr_scheduler=lambda opt: lr_schedule(opt, cfg.lr_schedule, cfg.warmup_steps, total),
    )
    reference = None
    if is_lora(model) and cfg.beta != 0:
        reference = AdapterDisabled(engine, model)
    if reference_lm is not None:
        reference = PolicyHead(reference_lm.to(device), cfg.loss_backend)
        if cfg.zero_stage == 3:
            reference_config = {
                key: ds_config[key]
                for key in (
                    "train_micro_batch_size_per_gpu",
                    "gradient_accumulation_steps",
                    "train_batch_size",
                    "zero_optimization",
                    "bf16",
                )
            }
            reference, *_ = deepspeed.initialize(model=reference, config=reference_config)
        elif ds_config["bf16"]["enabled"]:
            reference = reference.to(torch.bfloat16)
    return engine, reference


def with_lora(model, cfg: TrainConfig):
    return apply_lora(
        model,
        rank=cfg.lora_rank,
        alpha=cfg.lora_alpha,
        dropout=cfg.lora_dropout,
        target_modules=cfg.lora_target_modules,
    )


def policy_and_reference(cfg: TrainConfig, model):
    """(the policy, the reference LM or None) at the start of RL. With LoRA the policy carries an
    adapter (the warm start's, or a fresh one) and the reference is the policy with it disabled
    (None here: `build_engines` makes it); otherwise a frozen copy of `model` when ``beta != 0``."""
    if cfg.lora_rank:
        return (model if is_lora(model) else with_lora(model, cfg)), None
    return model, (copy.deepcopy(model).requires_grad_(False).eval() if cfg.beta != 0 else None)


def chat_prompted(cfg: TrainConfig, task, tokenizer):
    """`task` with its prompts through the chat template ``chat_template`` (after ``system_prompt``),
    else `task` (`sage_train.tasks.chat`; "official" installs the template on `tokenizer`)."""
    if not cfg.chat_template:
        return task
    from .tasks.chat import ChatPromptTask

    return ChatPromptTask(task, tokenizer, cfg.system_prompt, cfg.chat_template)


def rollout_model_path(cfg: TrainConfig, model, tokenizer, run_dir: Path, rank: int) -> str:
    """What an engine that loads weights itself (vllm) starts from: `cfg.model`, or, for a model
    built here ("tiny") or warm-started, a copy saved to ``run_dir/rollout_init`` (HF format).
    The engine then receives the policy's weights before the first step in any case."""
    if cfg.rollout_engine != "vllm":
        return cfg.model
    if cfg.model != "tiny" and (not cfg.warm_start or is_lora(model)):  # an adapter: the base loads
        return model_directory(cfg.model, cfg.gguf_file)  # a named model or GGUF file: its cached conversion
    path = run_dir / "rollout_init"
    if rank == 0:
        if is_lora(model):  # the warm start's adapter, merged out of place
            base_lm(model).save_pretrained(path, state_dict=dict(merged_named_weights(model)))
        else:
            model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    dist.barrier()
    return str(path)


def build_rollout(
    cfg: TrainConfig, lm, tokenizer, model_path: str, device, rank: int, world: int, prompts: Iterable[str] = ()
):
    """The rollout engine of ``cfg.rollout_engine``, sampling from `lm` (the policy module).

    prompts: every prompt the run samples (RL and evaluation), read only to derive vLLM's
    context length when ``vllm_max_model_len`` is 0 (`derived_max_model_len`)."""
    if cfg.rollout_engine == "hf":
        return make_engine(
            "hf",
            lm,
            tokenizer,
            device=device,
            synced_gpus=cfg.zero_stage == 3 and world > 1,
            max_rows=cfg.prompts_per_step // world * cfg.group_size,  # no generate larger than a step's
            dtype=getattr(torch, cfg.hf_rollout_dtype) if cfg.hf_rollout_dtype else None,
        )
    if cfg.rollout_engine == "vllm":
        from .rollout.vllm import logprobs_mode_for

        return make_engine(
            "vllm",
            model_path,
            tokenizer,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            enable_sleep_mode=cfg.vllm_sleep_mode,
            sync_bucket_mb=cfg.vllm_sync_bucket_mb,
            max_model_len=cfg.vllm_max_model_len or derived_max_model_len(cfg, tokenizer, prompts),
            max_num_batched_tokens=cfg.vllm_max_num_batched_tokens or None,
            dtype=cfg.vllm_dtype,
            seed=cfg.seed + rank,
            logprobs_mode=logprobs_mode_for(cfg.temperature),
        )
    shared = cfg.openai_shared_dir or str(cfg.run_dir / "adapters")
    return make_engine(
        "openai",
        cfg.openai_base_url,
        tokenizer,
        served_model=cfg.openai_model or cfg.model,
        base_model=cfg.model,  # config.validate: no warm start, so the adapter's base is `model`
        shared_dir=os.path.join(shared, f"rank{rank}"),
        adapter_name=f"policy-rank{rank}",
    )


def derived_max_model_len(cfg: TrainConfig, tokenizer, prompts: Iterable[str]) -> int:
    """The longest of `prompts` in tokens plus the larger of ``max_new_tokens`` and
    ``eval_max_new_tokens``: the longest sequence the run can ask of the engine."""
    texts = list(prompts)
    if not texts:
        raise ConfigError("config key 'vllm_max_model_len' is 0 (derived) but no prompt was given to derive it from")
    longest = max(map(len, tokenizer(texts, add_special_tokens=False)["input_ids"]))
    return longest + max(cfg.max_new_tokens, cfg.eval_max_new_tokens)


def check_batch_shape(cfg: TrainConfig, world: int) -> int:
    """Each rank's rows per step (its prompts x group_size); they must split into micro-batches
    (of ``micro_batch_size`` rows, unless a token budget makes them)."""
    local_rows = cfg.prompts_per_step // world * cfg.group_size
    if cfg.prompts_per_step % world or (local_rows % cfg.micro_batch_size and not cfg.max_tokens_per_micro_batch):
        raise ConfigError(
            f"config key 'prompts_per_step' ({cfg.prompts_per_step}) must split evenly over "
            f"{world} rank(s), and each rank's prompts x group_size ({local_rows}) into "
            f"'micro_batch_size' ({cfg.micro_batch_size}) micro-batches"
        )
    return local_rows


def deepspeed_config(cfg: TrainConfig, world: int, accumulation: int, device: torch.device) -> dict:
    """The DeepSpeed config implied by `cfg`, with ``cfg.deepspeed_config`` (a file) merged over it."""
    config = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": cfg.micro_batch_size * accumulation * world,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": {"stage": cfg.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": device.type == "cuda" and cfg.bf16},
        "steps_per_print": 2**31,
        "wall_clock_breakdown": False,
    }
    if cfg.deepspeed_config:
        from .config import read_yaml  # JSON is YAML too

        for key, value in read_yaml(cfg.deepspeed_config).items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
    stage = config["zero_optimization"].get("stage", 0)
    if stage != cfg.zero_stage:
        raise ConfigError(
            f"config key 'deepspeed_config' ({cfg.deepspeed_config}) sets ZeRO stage {stage} but "
            f"'zero_stage' is {cfg.zero_stage}; make them agree (the trainer reads zero_stage)"
        )
    return config


def make_guide(cfg: TrainConfig, rank: int) -> Guide | None:
    """The run's guide (`sage_kernels.guides.GUIDES[cfg.guide]`), or None for ``guide: none``.
    A scheduled guide's schedule runs over the run's optimizer steps; its noise is seeded per rank."""
    bounds = {"q_min": cfg.q_min, "q_max": cfg.q_max}
    if cfg.guide == "branch":
        return BranchGuide(gamma=cfg.gamma, tau=cfg.tau, **bounds)
    schedule = {
        "max_steps": cfg.steps,
        "sigma_max": cfg.guide_sigma_max,
        "sigma_min": cfg.guide_sigma_min,
        "num_cycles": cfg.guide_num_cycles,
        "decay_rate": cfg.guide_decay_rate,
        "seed": cfg.seed * 1009 + rank,
        **bounds,
    }
    if cfg.guide == "token":
        return TokenGuide(
            alpha_max=cfg.guide_alpha_max,
            alpha_min=cfg.guide_alpha_min,
            normalization=cfg.guide_normalization,
            **schedule,
        )
    if cfg.guide == "random":
        return RandomGuide(eps_max=cfg.guide_eps_max, eps_min=cfg.guide_eps_min, **schedule)
    return None
