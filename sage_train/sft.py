"""The supervised warm start (SFT): the plain AdamW phase that makes the model RL starts from, run by
`sage_train.build.initial_policy` before the RL engine exists."""

from __future__ import annotations

import random

import torch

from .config import TrainConfig
from .policy import lr_schedule

#: steps over which the warm start's loss is averaged for ``sft_target_loss``
SFT_WINDOW = 50


def sft_warm_start(model, tokenizer, examples: list[tuple[list[int], list[int]]], cfg: TrainConfig) -> int:
    """The supervised warm start, the model RL starts from: a plain AdamW phase on the task's correct
    completions, ``prompt + completion + EOS`` (`inputs.sft_examples`), the loss on completion tokens
    only, run identically on every rank (it needs no communication) before the RL engine exists; it
    computes the model's logits, which the RL phase never does. Deterministic in ``cfg.seed``.
    ``sft_epochs > 0`` passes over the examples that many times, shuffled each epoch; otherwise
    ``sft_steps`` batches are drawn with replacement. The learning rate warms up linearly over
    ``sft_warmup_steps``, then decays to 0 (``sft_lr_schedule``).

    With ``sft_target_loss`` it stops once the mean loss of the last `SFT_WINDOW` steps is below
    it: how fast a tiny model learns arithmetic varies a lot with the seed (some seeds reach 95%
    in the steps where others reach 15%), and RL needs a start that is neither. Returns the
    number of steps taken."""
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
