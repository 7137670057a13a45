"""The supervised warm start (SFT): the plain AdamW phase that makes the model RL starts from, run by
`sage_train.build.initial_policy` before the RL engine exists, on the examples `sft_examples` makes of
a task's worked solutions (checked by `sage_train.inputs.check_inputs`)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from .errors import ConfigError
from .optim import LR_SCHEDULES, lr_schedule
from .tasks.chat import official_sft_completion

#: steps over which the warm start's loss is averaged for ``sft_target_loss``
SFT_WINDOW = 50
#: ``sft_format``'s values: the task's worked solutions as they are, or the official SAGE target
SFT_FORMATS = ("raw", "official")
#: ``sft_adapter``'s values: what RL does with a LoRA warm start's adapter (`build.initial_policy`)
SFT_ADAPTERS = ("merge", "continue")
#: ``sft_lr_schedule``'s values: the warm start decays to 0 (no constant schedule)
SFT_LR_SCHEDULES = tuple(kind for kind in LR_SCHEDULES if kind != "constant")


@dataclass(frozen=True)
class SftSettings:
    """The warm start's keys: its examples (``sft_task``'s worked solutions per ``sft_format``, cut at
    ``sft_max_tokens``, those over ``sft_max_example_tokens`` dropped), its optimiser and length
    (``sft_steps`` batches or ``sft_epochs`` passes), its early stop, and what RL does with a LoRA
    adapter (``sft_adapter``)."""

    seed: int
    sft_steps: int
    sft_epochs: int
    sft_batch_size: int
    sft_lr: float
    sft_lr_schedule: str
    sft_warmup_steps: int
    sft_weight_decay: float
    sft_target_loss: float
    sft_max_tokens: int
    sft_max_example_tokens: int
    sft_format: str
    sft_task: str
    sft_adapter: str

    @property
    def warm_start(self) -> bool:
        """Whether a supervised warm start runs (``sft_steps`` or ``sft_epochs``)."""
        return self.sft_steps > 0 or self.sft_epochs > 0


def sft_warm_start(model, tokenizer, examples: list[tuple[list[int], list[int]]], sft: SftSettings) -> int:
    """The supervised warm start, the model RL starts from: a plain AdamW phase on the task's correct
    completions, ``prompt + completion + EOS`` (`sft_examples`), the loss on completion tokens
    only, run identically on every rank (it needs no communication) before the RL engine exists; it
    computes the model's logits, which the RL phase never does. Deterministic in ``seed``.
    ``sft_epochs > 0`` passes over the examples that many times, shuffled each epoch; otherwise
    ``sft_steps`` batches are drawn with replacement. The learning rate warms up linearly over
    ``sft_warmup_steps``, then decays to 0 (``sft_lr_schedule``).

    With ``sft_target_loss`` it stops once the mean loss of the last `SFT_WINDOW` steps is below
    it: how fast a tiny model learns arithmetic varies a lot with the seed (some seeds reach 95%
    in the steps where others reach 15%), and RL needs a start that is neither. Returns the
    number of steps taken."""
    rng = random.Random(f"sft:{sft.seed}")
    if sft.sft_epochs:
        order = []
        for _ in range(sft.sft_epochs):
            order += rng.sample(range(len(examples)), len(examples))
        batches = [order[i : i + sft.sft_batch_size] for i in range(0, len(order), sft.sft_batch_size)]
    else:
        batches = [[rng.randrange(len(examples)) for _ in range(sft.sft_batch_size)] for _ in range(sft.sft_steps)]
    total = len(batches)
    device = next(model.parameters()).device
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=sft.sft_lr, weight_decay=sft.sft_weight_decay)

    schedule = lr_schedule(optimizer, sft.sft_lr_schedule, sft.sft_warmup_steps, total)
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
        if sft.sft_target_loss:
            recent = (recent + [loss.detach()])[-SFT_WINDOW:]
            if step % SFT_WINDOW == 0 and float(torch.stack(recent).mean()) < sft.sft_target_loss:
                break
    return step


def sft_examples(
    task, problems: list, tokenizer, sft: SftSettings, task_name: str
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids + EOS) of each problem with a worked solution
    (``meta["sft_completion"]``), formatted per ``sft_format`` and filtered by
    ``sft_max_example_tokens``; completions cut at ``sft_max_tokens``. `task_name` names the task in a refusal."""
    pairs = []
    for p in problems:
        if "sft_completion" not in p.meta:
            continue
        completion = p.meta["sft_completion"]
        if sft.sft_format == "official":
            if not is_number(p.answer):  # the official warm start keeps numeric answers only
                continue
            completion = official_sft_completion(completion, p.answer)
        pairs.append((task.prompt(p), completion))
    if not pairs:
        raise ConfigError(
            f"sft_steps: task {task_name!r} gives no meta['sft_completion'] to warm-start on "
            "(with sft_format 'official': none with a numeric answer); set sft_steps=0"
        )
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    completions = tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    examples = [(p, c + [tokenizer.eos_token_id]) for p, c in zip(prompts, completions)]
    if sft.sft_max_example_tokens:
        examples = [(p, c) for p, c in examples if len(p) + len(c) <= sft.sft_max_example_tokens]
        if not examples:
            raise ConfigError(f"sft_max_example_tokens: no example is {sft.sft_max_example_tokens} tokens or shorter")
    if sft.sft_max_tokens:
        examples = [(p, c[: sft.sft_max_tokens]) for p, c in examples]
    return examples


def is_number(text: str) -> bool:
    """Whether `text` reads as a number (the official filter: pandas.to_numeric is not NaN)."""
    try:
        return not math.isnan(float(text))
    except ValueError:
        return False
