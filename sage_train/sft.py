"""The supervised warm start: the model RL starts from.

A plain AdamW phase on the task's correct completions, run identically on every rank (it needs
no communication) before the RL engine exists; it computes the model's logits, which the RL
phase never does.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import torch

from .build import chat_prompted, with_lora
from .config import ConfigError, TrainConfig
from .lora import merge_lora
from .model import load_model_and_tokenizer, load_pretrained

#: steps over which the warm start's loss is averaged for ``sft_target_loss``
SFT_WINDOW = 50


def initial_policy(cfg: TrainConfig, task, train_problems: list, run_dir: Path, rank: int, *, resumed: bool):
    """The model RL starts from: `cfg.model`, warm-started by SFT when ``sft_steps > 0``.

    With LoRA the warm start trains an adapter. ``sft_adapter: continue`` (the official SAGE way)
    returns that adapter on the raw base model, and RL goes on training it, so the reference (the
    adapter disabled) is the pre-SFT base; ``merge`` merges it into the weights, and RL puts a
    fresh adapter on the merged model, whose reference is then the warm-started model.

    The warm-started model (or adapter) is saved to ``run_dir/sft``; a resumed run rebuilds the
    reference from there, or for ``continue`` from `cfg.model` (its policy weights then come from
    the checkpoint)."""
    sft_dir = run_dir / "sft"
    continue_adapter = cfg.lora_rank > 0 and cfg.sft_adapter == "continue"
    if cfg.sft_steps and resumed and continue_adapter:
        model, tokenizer = load_model_and_tokenizer(cfg)
        return with_lora(model, cfg), tokenizer
    if cfg.sft_steps and resumed and (sft_dir / "config.json").is_file():
        return load_pretrained(str(sft_dir))
    model, tokenizer = load_model_and_tokenizer(cfg)
    if cfg.sft_steps:
        if torch.cuda.is_available():  # warm-start where RL will run, not on the host
            model.to(torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))))
        if cfg.lora_rank:
            model = with_lora(model, cfg)
        steps = sft_warm_start(model, tokenizer, chat_prompted(cfg, task, tokenizer), train_problems, cfg)
        if not continue_adapter:
            model = merge_lora(model)
        if rank == 0:
            print(f"sage-train: warm start done after {steps} SFT steps", flush=True)
            model.save_pretrained(sft_dir)
            tokenizer.save_pretrained(sft_dir)
    return model, tokenizer


def sft_warm_start(model, tokenizer, task, problems: list, cfg: TrainConfig) -> int:
    """Supervised fine-tuning on ``prompt + meta["sft_completion"] + EOS`` (the task's correct
    completions), the loss on completion tokens only. Deterministic in ``cfg.seed``.

    With ``sft_target_loss`` it stops once the mean loss of the last `SFT_WINDOW` steps is below
    it: how fast a tiny model learns arithmetic varies a lot with the seed (some seeds reach 95%
    in the steps where others reach 15%), and RL needs a start that is neither. Returns the
    number of steps taken."""
    examples = [(task.prompt(p), p.meta["sft_completion"]) for p in problems if "sft_completion" in p.meta]
    if not examples:
        raise ConfigError(
            f"sft_steps: task {cfg.task!r} gives no meta['sft_completion'] to warm-start on; set sft_steps=0"
        )
    device = next(model.parameters()).device
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.sft_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / cfg.sft_steps))
    )
    rng = random.Random(f"sft:{cfg.seed}")
    model.train()
    recent = []
    for step in range(1, cfg.sft_steps + 1):
        chosen = [examples[rng.randrange(len(examples))] for _ in range(cfg.sft_batch_size)]
        prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in chosen]
        answers = [
            tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for _, a in chosen
        ]
        if cfg.sft_max_tokens:
            answers = [a[: cfg.sft_max_tokens] for a in answers]
        width = max(len(p) + len(a) for p, a in zip(prompts, answers))
        input_ids = torch.full((len(chosen), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full_like(input_ids, -100)
        attention_mask = torch.zeros_like(input_ids)
        for row, (p, a) in enumerate(zip(prompts, answers)):
            start = width - len(p) - len(a)  # left padding, as in generation
            input_ids[row, start:] = torch.tensor(p + a)
            labels[row, width - len(a) :] = torch.tensor(a)
            attention_mask[row, start:] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        loss = model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            labels=labels.to(device),
        ).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if cfg.sft_target_loss:
            recent = (recent + [loss.detach()])[-SFT_WINDOW:]
            if step % SFT_WINDOW == 0 and float(torch.stack(recent).mean()) < cfg.sft_target_loss:
                break
    return step
