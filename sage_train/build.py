"""The one builder: `build_context` turns a checked `RunPlan` (`sage_train.inputs`) into the run's
`RunContext`, in this order: the policy the run starts from (the warm start, `sft.sft_warm_start`, or its
saved result on resume), the reference, the DeepSpeed engine and optimiser of the policy, the run's prompted tasks and
what it evaluates, the rollout engine and the guide computed outside the loss. It checks nothing
`check_inputs` checked."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist

from .config import TrainConfig
from .context import RunContext
from .errors import ConfigError
from .guide import make_guide
from .inputs import RunPlan, evaluation_sets, run_prompts
from .micro_batches import padding_free
from .models.loading import load_folder, model_for
from .models.lora import AdapterDisabled, base_lm, is_lora, merge_lora, merged_named_weights, with_lora
from .policy import PolicyHead, lr_schedule
from .presets import loss_config
from .rollout.base import make_engine
from .run_files import RUN_FILES
from .safe_files import folder_written_atomically
from .sft import sft_warm_start
from .tasks.chat import chat_prompted


def build_context(plan: RunPlan, rank: int, device: torch.device) -> RunContext:
    """The run's models (the warm start, or its saved result on resume), engines, prompted tasks and
    evaluation sets, rollout engine and guide, in that order (the rollout engine's context length is derived from
    every prompt the run samples)."""
    cfg = plan.cfg
    model, tokenizer = initial_policy(plan, rank, resumed=cfg.resume)
    rollout_init = rollout_model_path(plan, model, tokenizer, rank)
    model, reference_lm = policy_and_reference(cfg, model)
    packed, why_padded = padding_free(cfg, model)
    if why_padded and cfg.padding_free is None and rank == 0:
        print(f"sage-train: padded micro-batches: {why_padded}", flush=True)
    engine, reference = build_engines(cfg, model, reference_lm, plan.deepspeed, device)
    task = chat_prompted(cfg, plan.task, tokenizer)
    held_out_task = chat_prompted(cfg, plan.eval_task, tokenizer) if plan.eval_task else task
    evaluations = evaluation_sets(cfg, task, held_out_task, plan.train_problems, plan.held_out)
    prompts = run_prompts(task, plan.train_problems, evaluations)  # read only to derive vLLM's context length
    rollout = build_rollout(cfg, engine.module.lm, tokenizer, rollout_init, device, rank, plan.world, prompts)
    guide = make_guide(cfg, rank)
    return RunContext(
        cfg,
        engine,
        reference,
        rollout,
        tokenizer,
        task,
        plan.train_problems,
        guide,
        rank,
        plan.world,
        device,
        loss=loss_config(cfg),
        padding_free=packed,
        evaluations=evaluations,
    )


def initial_policy(plan: RunPlan, rank: int, *, resumed: bool):
    """(model, tokenizer) RL starts from: the plan's model, warm-started by SFT when ``sft_steps``
    or ``sft_epochs`` > 0 (`sft.sft_warm_start`).

    With LoRA the warm start trains an adapter. ``sft_adapter: continue`` (the official SAGE way)
    returns that adapter on the raw base model, and RL goes on training it, so the reference (the
    adapter disabled) is the pre-SFT base; ``merge`` merges it into the weights, and RL puts a
    fresh adapter on the merged model, whose reference is then the warm-started model.

    The warm-started model (or adapter) is saved to ``run_dir/sft``; a resumed run rebuilds the
    reference from there (with the tokenizer saved there), or for ``continue`` from the plan's
    model (its policy weights then come from the checkpoint)."""
    cfg, tokenizer = plan.cfg, plan.tokenizer
    sft_dir = cfg.run_dir / RUN_FILES.sft
    continue_adapter = cfg.lora_rank > 0 and cfg.sft_adapter == "continue"
    if cfg.warm_start and resumed and continue_adapter:
        return with_lora(model_for(cfg, plan.model, tokenizer), cfg), tokenizer
    if cfg.warm_start and resumed and (sft_dir / "config.json").is_file():
        return load_folder(str(sft_dir))  # the HF folder this run saved
    model = model_for(cfg, plan.model, tokenizer)
    if cfg.warm_start:
        if torch.cuda.is_available():  # warm-start where RL will run, not on the host
            model.to(torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))))
        if cfg.lora_rank:
            model = with_lora(model, cfg)
        steps = sft_warm_start(model, tokenizer, plan.sft_examples, cfg)
        if not continue_adapter:
            model = merge_lora(model)
        if rank == 0:
            print(f"sage-train: warm start done after {steps} SFT steps", flush=True)
            with folder_written_atomically(sft_dir) as staged:  # a resume loads it when config.json is there
                model.save_pretrained(staged)
                tokenizer.save_pretrained(staged)
                (staged / RUN_FILES.warm_start).write_text(json.dumps({"sft_steps": steps}) + "\n")  # what made it
    return model, tokenizer


def build_engines(cfg: TrainConfig, model, reference_lm, ds_config: dict, device: torch.device):
    """The DeepSpeed engine of the policy and the reference scorer (ZeRO-3-partitioned under stage 3),
    configured by `ds_config` (the plan's, `inputs.deepspeed_config`)."""
    import deepspeed

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


def policy_and_reference(cfg: TrainConfig, model):
    """(the policy, the reference LM or None) at the start of RL. With LoRA the policy carries an
    adapter (the warm start's, or a fresh one) and the reference is the policy with it disabled
    (None here: `build_engines` makes it); otherwise a frozen copy of `model` when ``beta != 0``."""
    if cfg.lora_rank:
        return (model if is_lora(model) else with_lora(model, cfg)), None
    return model, (copy.deepcopy(model).requires_grad_(False).eval() if cfg.beta != 0 else None)


def rollout_model_path(plan: RunPlan, model, tokenizer, rank: int) -> str:
    """What an engine that loads weights itself (vllm) starts from: the plan's model source, or, for
    a model built here ("tiny") or warm-started, a copy saved to ``run_dir/rollout_init`` (HF format).
    The engine then receives the policy's weights before the first step in any case."""
    cfg = plan.cfg
    if cfg.rollout_engine != "vllm":
        return cfg.model
    if cfg.model != "tiny" and (not cfg.warm_start or is_lora(model)):  # an adapter: the base loads
        return plan.model  # a named model or GGUF file: its cached conversion
    path = cfg.run_dir / RUN_FILES.rollout_init
    if rank == 0:  # saved afresh, then renamed: a copy's files (cp -al: hard links) are never written through
        with folder_written_atomically(path) as staged:
            if is_lora(model):  # the warm start's adapter, merged out of place
                base_lm(model).save_pretrained(staged, state_dict=dict(merged_named_weights(model)))
            else:
                model.save_pretrained(staged)
            tokenizer.save_pretrained(staged)
    dist.barrier()
    return str(path)


def build_rollout(
    cfg: TrainConfig, lm, tokenizer, model_path: str, device, rank: int, world: int, prompts: Iterable[str] = ()
):
    """The rollout engine of ``cfg.rollout_engine``, sampling from `lm` (the policy module).

    prompts: every prompt the run samples (RL and evaluation), read only to derive vLLM's
    context length when ``vllm_max_model_len`` is 0 (`derived_max_model_len`)."""
    if cfg.rollout_engine == "vllm":
        max_model_len = cfg.vllm_max_model_len or derived_max_model_len(cfg, tokenizer, prompts)
        return make_engine(
            "vllm",
            model_path,
            tokenizer,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            enable_sleep_mode=cfg.vllm_sleep_mode,
            sync_bucket_mb=cfg.vllm_sync_bucket_mb,
            max_model_len=max_model_len,
            max_num_batched_tokens=cfg.vllm_max_num_batched_tokens or None,
            dtype=cfg.vllm_dtype,
            seed=cfg.seed + rank,
            temperature=cfg.temperature,  # the engine reports log-probs of the distribution sampled at it
        )
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
    shared = cfg.openai_shared_dir or str(cfg.run_dir / RUN_FILES.adapters)
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
