"""The supervised warm start: the model RL starts from.

A plain AdamW phase on the task's correct completions, run identically on every rank (it needs
no communication) before the RL engine exists; it computes the model's logits, which the RL
phase never does.
"""

from __future__ import annotations

import math
import random

import torch

from .config import ConfigError, TrainConfig
from .lr_schedule import lr_schedule
from .tasks.chat import official_sft_completion

#: steps over which the warm start's loss is averaged for ``sft_target_loss``
SFT_WINDOW = 50


def sft_examples(task, problems: list, tokenizer, cfg: TrainConfig) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids + EOS) of each problem with a worked solution
    (``meta["sft_completion"]``), formatted per ``sft_format`` and filtered by
    ``sft_max_example_tokens``; completions cut at ``sft_max_tokens``."""
    pairs = []
    for p in problems:
        if "sft_completion" not in p.meta:
            continue
        completion = p.meta["sft_completion"]
        if cfg.sft_format == "official":
            if not is_number(p.answer):  # the official warm start keeps numeric answers only
                continue
            completion = official_sft_completion(completion, p.answer)
        pairs.append((task.prompt(p), completion))
    if not pairs:
        raise ConfigError(
            f"sft_steps: task {cfg.sft_task or cfg.task!r} gives no meta['sft_completion'] to warm-start on "
            "(with sft_format 'official': none with a numeric answer); set sft_steps=0"
        )
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    completions = tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    examples = [(p, c + [tokenizer.eos_token_id]) for p, c in zip(prompts, completions)]
    if cfg.sft_max_example_tokens:
        examples = [(p, c) for p, c in examples if len(p) + len(c) <= cfg.sft_max_example_tokens]
        if not examples:
            raise ConfigError(f"sft_max_example_tokens: no example is {cfg.sft_max_example_tokens} tokens or shorter")
    if cfg.sft_max_tokens:
        examples = [(p, c[: cfg.sft_max_tokens]) for p, c in examples]
    return examples


def is_number(text: str) -> bool:
    """Whether `text` reads as a number (the official filter: pandas.to_numeric is not NaN)."""
    try:
        return not math.isnan(float(text))
    except ValueError:
        return False


def sft_warm_start(model, tokenizer, task, problems: list, cfg: TrainConfig) -> int:
    """Supervised fine-tuning on ``prompt + completion + EOS`` (`sft_examples`), the loss on
    completion tokens only. Deterministic in ``cfg.seed``. ``sft_epochs > 0`` passes over the
    examples that many times, shuffled each epoch; otherwise ``sft_steps`` batches are drawn with
    replacement. The learning rate warms up linearly over ``sft_warmup_steps``, then decays to 0
    (``sft_lr_schedule``).

    With ``sft_target_loss`` it stops once the mean loss of the last `SFT_WINDOW` steps is below
    it: how fast a tiny model learns arithmetic varies a lot with the seed (some seeds reach 95%
    in the steps where others reach 15%), and RL needs a start that is neither. Returns the
    number of steps taken."""
    examples = sft_examples(task, problems, tokenizer, cfg)
    rng = random.Random(f"sft:{cfg.seed}")
    if cfg.sft_epochs:
        order = []
        for _ in range(cfg.sft_epochs):
            order += rng.sample(range(len(examples)), len(examples))
        batches = [order[i : i + cfg.sft_batch_size] for i in range(0, len(order), cfg.sft_batch_size)]
    else:
        batches = [[rng.randrange(len(examples)) for _ in range(cfg.sft_batch_size)] for _ in range(cfg.sft_steps)]
    total = len(batches)
    device = next(model.parameters()).device
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.sft_lr, weight_decay=cfg.sft_weight_decay)

    schedule = lr_schedule(optimizer, cfg.sft_lr_schedule, cfg.sft_warmup_steps, total)
    model.train()
    recent = []
    for step, indices in enumerate(batches, 1):
        chosen = [examples[i] for i in indices]
        width = max(len(p) + len(a) for p, a in chosen)
        input_ids = torch.full((len(chosen), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full_like(input_ids, -100)
        attention_mask = torch.zeros_like(input_ids)
        for row, (p, a) in enumerate(chosen):
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
