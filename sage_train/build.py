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

from .context import RunContext, RunSettings
from .errors import ConfigError
from .guide import make_guide
from .inputs import RunPlan, evaluation_sets, run_prompts
from .micro_batches import padding_free
from .models.loading import load_folder, model_for
from .models.lora import AdapterDisabled, LoraSettings, base_lm, is_lora, merge_lora, merged_named_weights, with_lora
from .optim import OptimSettings, lr_schedule
from .policy import PolicyHead
from .rollout.base import RolloutSettings, make_engine
from .run_files import RUN_FILES
from .safe_files import folder_written_atomically
from .sft import sft_warm_start
from .tasks.chat import chat_prompted


def build_context(plan: RunPlan, rank: int, device: torch.device) -> RunContext:
    """The run's models (the warm start, or its saved result on resume), engines, prompted tasks and
    evaluation sets, rollout engine and guide, in that order (the rollout engine's context length is derived from
    every prompt the run samples)."""
    settings = plan.settings
    run, loss = settings.run, settings.loss
    model, tokenizer = initial_policy(plan, rank, resumed=run.resume)
    rollout_init = rollout_model_path(plan, model, tokenizer, rank)
    with_reference = settings.reward.beta != 0
    model, reference_lm = policy_and_reference(settings.lora, model, with_reference)
    packed, why_padded = padding_free(settings.step, loss.luspo_include_padding, model)
    if why_padded and settings.step.padding_free is None and rank == 0:
        print(f"sage-train: padded micro-batches: {why_padded}", flush=True)
    engine, reference = build_engines(settings.optim, model, reference_lm, plan.deepspeed, device, with_reference)
    task = chat_prompted(settings.chat, plan.task, tokenizer)
    held_out_task = chat_prompted(settings.chat, plan.eval_task, tokenizer) if plan.eval_task else task
    evaluations = evaluation_sets(settings.evaluation, task, held_out_task, plan.train_problems, plan.held_out)
    prompts = run_prompts(task, plan.train_problems, evaluations)  # read only to derive vLLM's context length
    rollout = build_rollout(
        settings.rollout,
        run,
        engine.module.lm,
        tokenizer,
        rollout_init,
        device,
        rank,
        plan.world,
        prompts,
        synced_gpus=settings.optim.zero_stage == 3 and plan.world > 1,
        max_rows=settings.step.prompts_per_step // plan.world * settings.step.group_size,  # a step's rows at most
    )
    guide = make_guide(run.guide, loss, settings.guide, steps=run.steps, seed=run.seed, rank=rank)
    return RunContext(
        settings,
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
        loss=loss,
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
    settings, tokenizer = plan.settings, plan.tokenizer
    sft, lora = settings.sft, settings.lora
    sft_dir = settings.run.run_dir / RUN_FILES.sft
    continue_adapter = lora.lora_rank > 0 and sft.sft_adapter == "continue"
    if sft.warm_start and resumed and continue_adapter:
        return with_lora(model_for(settings.model, plan.model, tokenizer), lora), tokenizer
    if sft.warm_start and resumed and (sft_dir / "config.json").is_file():
        return load_folder(str(sft_dir))  # the HF folder this run saved
    model = model_for(settings.model, plan.model, tokenizer)
    if sft.warm_start:
        if torch.cuda.is_available():  # warm-start where RL will run, not on the host
            model.to(torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))))
        if lora.lora_rank:
            model = with_lora(model, lora)
        steps = sft_warm_start(model, tokenizer, plan.sft_examples, sft)
        if not continue_adapter:
            model = merge_lora(model)
        if rank == 0:
            print(f"sage-train: warm start done after {steps} SFT steps", flush=True)
            with folder_written_atomically(sft_dir) as staged:  # a resume loads it when config.json is there
                model.save_pretrained(staged)
                tokenizer.save_pretrained(staged)
                (staged / RUN_FILES.warm_start).write_text(json.dumps({"sft_steps": steps}) + "\n")  # what made it
    return model, tokenizer


def build_engines(
    optim: OptimSettings, model, reference_lm, ds_config: dict, device: torch.device, with_reference: bool
):
    """The DeepSpeed engine of the policy and the reference scorer (ZeRO-3-partitioned under stage 3),
    configured by `ds_config` (the plan's, `inputs.deepspeed_config`). A LoRA policy's reference is the
    policy with its adapter off, when `with_reference` (beta != 0)."""
    import deepspeed

    policy = PolicyHead(model.to(device), optim.loss_backend, optim.gradient_checkpointing)
    trainable = [p for p in policy.parameters() if p.requires_grad]  # the adapter only under LoRA
    optimizer = torch.optim.AdamW(trainable, lr=optim.lr, weight_decay=optim.weight_decay)
    total = optim.steps * optim.num_iterations
    engine, *_ = deepspeed.initialize(
        model=policy,
        optimizer=optimizer,
        config=ds_config,
        lr_scheduler=lambda opt: lr_schedule(opt, optim.lr_schedule, optim.warmup_steps, total),
    )
    reference = None
    if is_lora(model) and with_reference:
        reference = AdapterDisabled(engine, model)
    if reference_lm is not None:
        reference = PolicyHead(reference_lm.to(device), optim.loss_backend)
        if optim.zero_stage == 3:
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


def policy_and_reference(lora: LoraSettings, model, with_reference: bool):
    """(the policy, the reference LM or None) at the start of RL. With LoRA the policy carries an
    adapter (the warm start's, or a fresh one) and the reference is the policy with it disabled
    (None here: `build_engines` makes it); otherwise a frozen copy of `model` when `with_reference`
    (beta != 0)."""
    if lora.lora_rank:
        return (model if is_lora(model) else with_lora(model, lora)), None
    return model, (copy.deepcopy(model).requires_grad_(False).eval() if with_reference else None)


def rollout_model_path(plan: RunPlan, model, tokenizer, rank: int) -> str:
    """What an engine that loads weights itself (vllm) starts from: the plan's model source, or, for
    a model built here ("tiny") or warm-started, a copy saved to ``run_dir/rollout_init`` (HF format).
    The engine then receives the policy's weights before the first step in any case."""
    run = plan.settings.run
    if plan.settings.rollout.rollout_engine != "vllm":
        return run.model
    if run.model != "tiny" and (not plan.settings.sft.warm_start or is_lora(model)):  # an adapter: the base loads
        return plan.model  # a named model or GGUF file: its cached conversion
    path = run.run_dir / RUN_FILES.rollout_init
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
    rollout: RolloutSettings,
    run: RunSettings,
    lm,
    tokenizer,
    model_path: str,
    device,
    rank: int,
    world: int,
    prompts: Iterable[str] = (),
    *,
    synced_gpus: bool,
    max_rows: int,
):
    """The rollout engine of ``rollout_engine``, sampling from `lm` (the policy module) of the run `run`.

    prompts: every prompt the run samples (RL and evaluation), read only to derive vLLM's
    context length when ``vllm_max_model_len`` is 0 (`derived_max_model_len`). The hf engine joins
    every rank's generate when `synced_gpus` (ZeRO-3) and samples at most `max_rows` rows at once."""
    if rollout.rollout_engine == "vllm":
        max_model_len = rollout.vllm_max_model_len or derived_max_model_len(rollout, tokenizer, prompts)
        return make_engine(
            "vllm",
            model_path,
            tokenizer,
            gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
            enable_sleep_mode=rollout.vllm_sleep_mode,
            sync_bucket_mb=rollout.vllm_sync_bucket_mb,
            max_model_len=max_model_len,
            max_num_batched_tokens=rollout.vllm_max_num_batched_tokens or None,
            dtype=rollout.vllm_dtype,
            seed=run.seed + rank,
            temperature=rollout.temperature,  # the engine reports log-probs of the distribution sampled at it
        )
    if rollout.rollout_engine == "hf":
        return make_engine(
            "hf",
            lm,
            tokenizer,
            device=device,
            synced_gpus=synced_gpus,
            max_rows=max_rows,
            dtype=getattr(torch, rollout.hf_rollout_dtype) if rollout.hf_rollout_dtype else None,
        )
    shared = rollout.openai_shared_dir or str(run.run_dir / RUN_FILES.adapters)
    return make_engine(
        "openai",
        rollout.openai_base_url,
        tokenizer,
        served_model=rollout.openai_model or run.model,
        base_model=run.model,  # config.validate: no warm start, so the adapter's base is `model`
        shared_dir=os.path.join(shared, f"rank{rank}"),
        adapter_name=f"policy-rank{rank}",
    )


def derived_max_model_len(rollout: RolloutSettings, tokenizer, prompts: Iterable[str]) -> int:
    """The longest of `prompts` in tokens plus the larger of ``max_new_tokens`` and
    ``eval_max_new_tokens``: the longest sequence the run can ask of the engine."""
    texts = list(prompts)
    if not texts:
        raise ConfigError("config key 'vllm_max_model_len' is 0 (derived) but no prompt was given to derive it from")
    longest = max(map(len, tokenizer(texts, add_special_tokens=False)["input_ids"]))
    return longest + max(rollout.max_new_tokens, rollout.eval_max_new_tokens)
