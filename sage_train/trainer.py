"""The RLVR training loop: rollouts -> rewards -> group advantages -> reference and behaviour
log-probs -> the fused SAGE loss -> a DeepSpeed optimizer step. `rl_step` is one step, top
to bottom; `train` is the run around it (warm start, evaluation, checkpoints, reports).

Launch:

    sage-train                                      # the packaged tiny-cpu default (python -m sage_train too)
    sage-train --config my.yaml --algorithm=dapo --steps=300
    torchrun --nproc_per_node 2 -m sage_train --zero_stage=2             # several processes, one machine
    torchrun --nproc_per_node 8 -m sage_train --config my.yaml --zero_stage=3 --deepspeed_config=ds-zero3
    deepspeed --num_gpus 8 --module sage_train --config my.yaml          # DeepSpeed's launcher
    torchrun --nnodes 4 --node_rank R --master_addr HOST --nproc_per_node 8 -m sage_train ...  # many machines
    deepspeed --num_gpus 8 --module sage_train --config r1-distill-qwen-7b-sage-branch  # a paper recipe

The paper's recipes (LoRA, colocated vLLM rollouts, official hyperparameters) are packaged
configs; docs/recipes.md lists them with the one-machine and multi-node commands.

Each process takes ``prompts_per_step / world_size`` prompts per step; gradients are averaged
by DeepSpeed. CPU runs use the gloo backend and float32; GPU runs NCCL and bf16.

RL simplifications in force (as in TRL's GRPOTrainer unless said):
- Prompts are drawn without replacement within a step, from the first ``train_problems`` training
  problems (all when 0), by a generator seeded with (seed, step).
- One rollout batch per step, used for ``num_iterations`` optimizer steps (default 1, where the
  ratio is 1 and clipping is inert). No value model; the reward is the task verifier's 0/1.
- The policy's log-probs are those of the temperature-scaled distribution; the sampler's top-p /
  top-k / min-p truncation is ignored in them. The hf engine samples from the training weights
  themselves, so there is no staleness; its `sync_weights` only re-points it at the policy.
- Rollout engines that hold their own weights (``rollout_engine`` vllm, openai) receive the
  policy's weights after every optimizer step (``rollout/sync_time`` logs the cost). With
  ``tis_level`` token or sequence, the PG term is reweighted by truncated importance sampling,
  min(pi_train / pi_rollout, tis_cap), both temperature-scaled log-probs (`rollout_correction`);
  engines that report log-probs after top-p / min-p truncation (hf) then give weights <= 1 on
  truncated distributions, so leave those samplers off, or TIS off, with the hf engine.
- The reference is the policy at the start of RL (after the warm start), frozen. With LoRA
  (``lora_rank > 0``, `sage_train.lora`) it is that model with the adapter disabled: no copy.
- The KL term is a per-token loss term, not a reward penalty.
- The supervised warm start is a plain AdamW phase run identically on every rank (it needs no
  communication); it computes the model's logits, which the RL phase never does.

Normalisers. The loss of one optimizer step is that of the whole batch, over all micro-batches
and ranks: grpo and dr_grpo weight each micro-batch by its share of the step's rows; bnpo and
dapo divide by the step's completion-token count, all-reduced over ranks once per step. Each
micro-batch's backward is then scaled by the world size and not by the accumulation steps, which
undoes DeepSpeed's averaging, so the gradient does not depend on the micro-batch size.

ZeRO-3. The LM head is partitioned like every other weight. The loss reads
``lm_head.weight`` inside the forward of `PolicyHead`, the module DeepSpeed wraps; ZeRO-3 then
gathers it there, registers it as an external parameter of that module, and gathers it again
for the backward, so the fused loss always sees the full [V, D] weight. Generation uses
``synced_gpus`` so that ranks that finish early keep joining the collective gathers.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from sage_kernels import fused_linear_sage_loss, logprobs_and_entropy
from sage_kernels.guides import RandomGuide, TokenGuide

from . import checkpoint, report
from .advantages import group_advantages
from .config import ConfigError, TrainConfig, load_yaml, parse_args, save_yaml
from .evaluate import evaluate_engine, grade, mean_pass_at_k
from .importance import truncated_is_weights
from .lora import AdapterDisabled, apply_lora, base_lm, is_lora, merge_lora, merged_named_weights
from .model import decoder_of, load_model_and_tokenizer, load_pretrained
from .presets import loss_config
from .rollout import SamplingParams, make_engine
from .tasks import get_task

#: keys that may differ between a run and its resumption (they do not change what is computed)
#: steps over which the warm start's loss is averaged for ``sft_target_loss``
SFT_WINDOW = 50
#: what a fresh run into an existing run directory removes first (the old run's outputs)
FRESH_RUN_CLEARS = (
    "checkpoints",
    "sft",
    "final",
    "tensorboard",
    "eval_before.json",
    "eval_after.json",
    "summary.json",
    "metrics.png",
)
RESUME_MAY_CHANGE = (
    "resume",
    "progress",
    "plots",
    "tensorboard",
    "log_every",
    "save_every",
    "keep_checkpoints",
)


# ----------------------------------------------------------------------------- the model as a loss head


class PolicyHead(nn.Module):
    """A causal LM seen through its last hidden states and LM head, never its logits.

    forward(batch) scores the completion tokens: per-token log-probs and entropies from
    `logprobs_and_entropy`. forward(batch, loss_inputs) returns (loss, the whole
    `fused_linear_sage_loss` output) instead. Both run inside this module's forward so that
    ZeRO-3 gathers the LM head.
    """

    def __init__(self, lm: nn.Module, backend: str = "auto") -> None:
        super().__init__()
        self.lm, self.backend = lm, backend

    def forward(
        self,
        input_ids,
        attention_mask,
        position_ids,
        completion_ids,
        prompt_length: int,
        temperature: float,
        loss_inputs: Optional[dict] = None,
    ):
        lm = base_lm(self.lm)  # under LoRA: the LM whose layers carry the (possibly disabled) adapter
        hidden = decoder_of(lm)(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        # the hidden state at position t predicts token t + 1: the completion starts at prompt_length
        hidden = hidden[:, prompt_length - 1 : prompt_length - 1 + completion_ids.shape[1]]
        head = lm.get_output_embeddings()
        if loss_inputs is None:
            return logprobs_and_entropy(
                hidden,
                head.weight,
                completion_ids,
                bias=head.bias,
                temperature=temperature,
                backend=self.backend,
            )
        output = fused_linear_sage_loss(
            hidden, head.weight, completion_ids, bias=head.bias, backend=self.backend, **loss_inputs
        )
        return output.loss, output  # the loss as a plain tensor output, so ZeRO-3 hooks its backward


@dataclass
class Batch:
    """A step's sequences: left-padded prompts followed by right-padded completions."""

    input_ids: torch.Tensor  # [B, P + L]
    attention_mask: torch.Tensor  # [B, P + L]
    position_ids: torch.Tensor  # [B, P + L], as `generate` numbers left-padded rows
    completion_ids: torch.Tensor  # [B, L]
    completion_mask: torch.Tensor  # [B, L] bool: tokens that count in the loss
    prompt_length: int  # P

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def model_inputs(self, rows: slice, temperature: float) -> dict:
        return {
            "input_ids": self.input_ids[rows],
            "attention_mask": self.attention_mask[rows],
            "position_ids": self.position_ids[rows],
            "completion_ids": self.completion_ids[rows],
            "prompt_length": self.prompt_length,
            "temperature": temperature,
        }


def make_batch(completions: list, device: torch.device, pad_id: int) -> Batch:
    """Pack completions (each with its prompt ids) into a `Batch` on `device`."""
    P = max(len(c.prompt_ids) for c in completions)
    L = max(1, max(len(c.completion_ids) for c in completions))
    input_ids = torch.full((len(completions), P + L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, c in enumerate(completions):
        prompt, completion = torch.tensor(c.prompt_ids), torch.tensor(c.completion_ids, dtype=torch.long)
        input_ids[row, P - len(prompt) : P] = prompt
        input_ids[row, P : P + len(completion)] = completion
        attention_mask[row, P - len(prompt) : P + len(completion)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    batch = Batch(
        input_ids, attention_mask, position_ids, input_ids[:, P:].clone(), attention_mask[:, P:].bool(), P
    )
    return Batch(*(x.to(device) if isinstance(x, torch.Tensor) else x for x in dataclasses.astuple(batch)))


@torch.no_grad()
def score(model: nn.Module, batch: Batch, micro_batch_size: int, temperature: float):
    """Per-token log-probs and entropies [B, L] of the completions under `model` (a PolicyHead)."""
    parts = [
        model(**batch.model_inputs(slice(start, start + micro_batch_size), temperature))
        for start in range(0, batch.rows, micro_batch_size)
    ]
    return torch.cat([logp for logp, _ in parts]), torch.cat([entropy for _, entropy in parts])


# ----------------------------------------------------------------------------- the step


@dataclass
class Context:
    """What the step needs, built once by `train`."""

    cfg: TrainConfig
    engine: object  # the DeepSpeed engine wrapping PolicyHead(policy)
    reference: Optional[Callable]  # PolicyHead(frozen reference), the adapter-disabled engine, or None
    rollout: object  # the rollout engine
    tokenizer: object
    task: object
    train_problems: list
    guide: object  # TokenGuide / RandomGuide, or None (branch: inside the loss)
    rank: int
    world: int
    device: torch.device


def rl_step(ctx: Context, step: int) -> dict:
    """One RL step; returns its metrics (tensors stay on the device, no host sync)."""
    cfg, start = ctx.cfg, time.perf_counter()

    # 1. rollouts and rewards: group_size completions per prompt, graded by the task's verifier
    groups, rewards, rounds = collect_groups(ctx, step)
    completions = [c for group in groups for c in group["completions"]]

    # 2. group advantages: (r - mean) / (std + 1e-4) within each prompt's group
    advantages = group_advantages(rewards, scale=cfg.scale_rewards).flatten().to(ctx.device)

    # 3. the batch; DAPO's overlong filtering drops completions cut by max_new_tokens from the loss
    batch = make_batch(completions, ctx.device, ctx.tokenizer.pad_token_id)
    truncated = torch.tensor([c.finish_reason == "length" for c in completions], device=ctx.device)
    if cfg.overlong_filter:
        batch.completion_mask &= ~truncated[:, None]

    # 4. behaviour and reference log-probs (no gradient), and the external guide if any
    mb = cfg.micro_batch_size
    old_logp, _ = score(ctx.engine, batch, mb, cfg.temperature)
    is_weights, tis_metrics = rollout_correction(cfg, completions, old_logp, batch)
    ref_logp = score(ctx.reference, batch, mb, cfg.temperature)[0] if ctx.reference is not None else None
    log_q = None
    if isinstance(ctx.guide, TokenGuide):
        log_q = ctx.guide(old_logp, batch.completion_mask)
    elif isinstance(ctx.guide, RandomGuide):
        log_q = ctx.guide(batch.completion_mask)

    # 5. the loss on hidden states + LM head, micro-batch by micro-batch, then the optimizer step
    totals = policy_update(ctx, batch, advantages, old_logp, ref_logp, log_q, is_weights)

    # 5b. the rollout engine samples the next step from the updated weights (hf: the live model already)
    ctx.rollout.sync_weights(ctx.engine.module.lm)

    # 6. metrics, still tensors; converted at log intervals
    lengths = batch.completion_mask.new_tensor(
        [len(c.completion_ids) for c in completions], dtype=torch.float32
    )
    metrics = {
        "reward": rewards.mean(),
        "reward_std": rewards.std(dim=1).mean(),
        "frac_reward_zero_std": (rewards.std(dim=1) == 0).float().mean(),
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/clipped_ratio": truncated.float().mean(),
        "num_tokens": batch.attention_mask.sum().float(),
        **totals.metrics(cfg.num_iterations),
        "learning_rate": ctx.engine.get_lr()[0],
        "step_time": time.perf_counter() - start,
        **tis_metrics,
    }
    if getattr(ctx.rollout, "last_sync_s", None) is not None:  # engines holding their own weights
        metrics["rollout/sync_time"] = ctx.rollout.last_sync_s
    if cfg.dynamic_sampling:
        metrics["dynamic_sampling/rounds"] = float(rounds)
    if ctx.guide is not None:
        metrics["guide/strength"] = ctx.guide.schedule.value()
    return metrics


def rollout_correction(cfg: TrainConfig, completions: list, train_logp, batch: Batch):
    """(is_weights [B, L] or None, metrics): truncated importance sampling between the rollout
    engine's log-probs and the trainer's (`sage_train.importance`), both temperature-scaled.
    None when ``tis_level`` is "off" or the engine returned no log-probs."""
    if cfg.tis_level == "off" or any(c.logprobs is None for c in completions):
        return None, {}
    rollout_logp = torch.zeros_like(train_logp)
    for row, c in enumerate(completions):
        rollout_logp[row, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=train_logp.dtype)
    mask = batch.completion_mask
    weights = truncated_is_weights(train_logp, rollout_logp, mask, level=cfg.tis_level, cap=cfg.tis_cap)
    tokens = mask.sum().clamp(min=1)
    log_ratio = torch.where(mask, train_logp.float() - rollout_logp.float(), 0.0)
    return weights, {
        "tis/weight_mean": (weights * mask).sum() / tokens,
        "tis/clipped_frac": ((weights >= cfg.tis_cap) & mask).sum() / tokens,
        "tis/abs_log_ratio": log_ratio.abs().sum() / tokens,
    }


def policy_update(
    ctx: Context, batch: Batch, advantages, old_logp, ref_logp, log_q, is_weights=None
) -> "LossTotals":
    """``num_iterations`` optimizer steps on the batch, each accumulated over micro-batches.

    The normalisers are the whole step's, over all micro-batches and ranks (module docstring),
    so the gradient does not depend on ``micro_batch_size``. The guide steps once per optimizer step.
    """
    cfg, mb = ctx.cfg, ctx.cfg.micro_batch_size
    loss_cfg, row_share = step_loss_config(ctx, batch)
    totals = LossTotals()
    for _ in range(cfg.num_iterations):
        for start_row in range(0, batch.rows, mb):
            rows = slice(start_row, start_row + mb)
            loss_inputs = {
                "mask": batch.completion_mask[rows],
                "advantages": advantages[rows],
                "old_logp": old_logp[rows],
                "ref_logp": None if ref_logp is None else ref_logp[rows],
                "log_q": None if log_q is None else log_q[rows],
                "is_weights": None if is_weights is None else is_weights[rows],
                "config": loss_cfg,
            }
            loss, out = ctx.engine(**batch.model_inputs(rows, cfg.temperature), loss_inputs=loss_inputs)
            loss = loss * row_share(rows)
            ctx.engine.backward(loss * ctx.world, scale_wrt_gas=False)  # undo DeepSpeed's averaging
            ctx.engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
            totals.add(loss, out, batch.completion_mask[rows])
        if ctx.guide is not None:
            ctx.guide.step()
    return totals


def collect_groups(ctx: Context, step: int):
    """This rank's groups for `step`: [{"problem", "completions", "rewards"}], rewards [G, n], rounds.

    With dynamic sampling (DAPO) only groups with mixed rewards are kept and more prompts are
    drawn to replace the others, for at most ``dynamic_sampling_max_rounds`` rounds; if the cap
    is hit, uninformative groups fill the batch (their advantages are zero), so every step has
    the same shape. All ranks run the same number of rounds (ZeRO-3 needs matching generate calls).
    """
    cfg = ctx.cfg
    needed = cfg.prompts_per_step // ctx.world
    informative, uninformative = [], []
    rounds = 0
    while True:
        problems = step_problems(ctx.train_problems, cfg.seed, step, rounds, cfg.prompts_per_step)[
            ctx.rank :: ctx.world
        ]
        params = SamplingParams(
            n=cfg.group_size,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            min_p=cfg.min_p,
            max_new_tokens=cfg.max_new_tokens,
            stop=tuple(cfg.stop),
            seed=rollout_seed(cfg.seed, step, rounds, ctx.rank),
        )
        outputs = ctx.rollout.generate([ctx.task.prompt(p) for p in problems], params)
        for problem, completions in zip(problems, outputs):
            scores = grade(ctx.task, [c.text for c in completions], problem)
            group = {"problem": problem, "completions": completions, "rewards": scores}
            (informative if len(set(scores)) > 1 or not cfg.dynamic_sampling else uninformative).append(group)
        rounds += 1
        if not cfg.dynamic_sampling:
            break
        done = len(informative) >= needed or rounds >= cfg.dynamic_sampling_max_rounds
        if all_ranks(done, ctx.device):
            break
    groups = (informative + uninformative)[:needed]
    rewards = torch.tensor([g["rewards"] for g in groups], dtype=torch.float32)
    return groups, rewards, rounds


def step_problems(pool: list, seed: int, step: int, round_: int, count: int) -> list:
    """The prompts of (step, round), the same on every rank: the data position is the step."""
    rng = random.Random(f"{seed}:{step}:{round_}")
    return [pool[i] for i in rng.sample(range(len(pool)), count)]


def rollout_seed(seed: int, step: int, round_: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 1009 + round_ * 101 + rank) % (2**31)


def all_ranks(flag: bool, device: torch.device) -> bool:
    """True when `flag` is true on every rank (a host sync: used where the host decides anyway)."""
    if dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def step_loss_config(ctx: Context, batch: Batch):
    """The step's LossConfig and `row_share(rows)`, the factor of a micro-batch's loss.

    grpo / dr_grpo average over rows: a micro-batch counts for its rows over the step's rows
    (prompts_per_step x group_size, the same on every step). bnpo / dapo average over tokens:
    the loss is given the step's completion-token count over all ranks (one all-reduce, no
    host sync) and micro-batches add up as they are.
    """
    base = loss_config(ctx.cfg)
    if base.loss_type in ("bnpo", "dapo"):
        tokens = batch.completion_mask.sum().float()
        if ctx.world > 1:
            dist.all_reduce(tokens)
        return base.replace(loss_type="dapo", num_items_in_batch=tokens.clamp(min=1.0)), lambda rows: 1.0
    total_rows = ctx.cfg.prompts_per_step * ctx.cfg.group_size
    return base, lambda rows: len(range(*rows.indices(batch.rows))) / total_rows


class LossTotals:
    """Sums of the loss and of the loss's metrics over micro-batches, token-weighted."""

    MEAN_METRICS = (
        "kl",
        "entropy",
        "sage/q_mean",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
    )

    def __init__(self) -> None:
        self.loss, self.tokens, self.sums = 0.0, 0.0, {}
        self.q_min, self.q_max = None, None

    def add(self, loss: torch.Tensor, out, mask: torch.Tensor) -> None:
        tokens = mask.sum().float()
        self.loss = self.loss + loss.detach()
        self.tokens = self.tokens + tokens
        for name in self.MEAN_METRICS:
            self.sums[name] = self.sums.get(name, 0.0) + out.metrics[name].float() * tokens
        q_min, q_max = out.metrics["sage/q_min"].float(), out.metrics["sage/q_max"].float()
        self.q_min = q_min if self.q_min is None else torch.minimum(self.q_min, q_min)
        self.q_max = q_max if self.q_max is None else torch.maximum(self.q_max, q_max)

    def metrics(self, iterations: int) -> dict:
        tokens = torch.as_tensor(self.tokens).clamp(min=1.0)
        means = {name: total / tokens for name, total in self.sums.items()}
        return {"loss": self.loss / iterations, **means, "sage/q_min": self.q_min, "sage/q_max": self.q_max}


# ----------------------------------------------------------------------------- the run


def main(argv: list[str]) -> int:
    """`sage-train [--config FILE] [--key=value ...]`; returns the exit status."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(usage())
        return 0
    try:
        cfg = parse_args(argv)
    except ConfigError as error:
        print(f"sage-train: {error}")
        return 2
    summary = train(cfg)
    if summary is None:
        return 1
    # 130: stopped by a signal after its checkpoint was written (a scheduler should not read it as done).
    return 130 if summary.get("interrupted") else 0


def usage() -> str:
    """The command line, then every config key with its default (the packaged default config's values)."""
    from .config import DEFAULT_CONFIG, packaged_config_names

    defaults = parse_args([])
    keys = "\n".join(f"  --{key}={value!r}" for key, value in defaults.to_dict().items())
    return (
        f"usage: sage-train [--config FILE_OR_PACKAGED_NAME] [--key=value ...]\n"
        f"packaged configs: {', '.join(packaged_config_names())} (default: {DEFAULT_CONFIG})\n"
        f"keys, with the default run's values:\n{keys}"
    )


def train(cfg: TrainConfig, on_step: Optional[Callable[[int, dict], None]] = None) -> dict:
    """Run `cfg` to the end (or to an interruption); returns the summary.

    on_step(step, row) is called on rank 0 after each logged step (tests use it to interrupt).
    """
    run_start = time.time()
    rank, world, device = init_distributed()
    check_batch_shape(cfg, world)
    if device.type == "cpu" and cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)  # tiny models run fastest on one thread per process
    run_dir = cfg.run_dir
    resume_step = prepare_run_dir(cfg, run_dir, rank)
    seed_everything(cfg.seed + rank)

    # models: the warm-started policy, and its frozen copy as the reference
    task = get_task(cfg.task, **cfg.task_options)
    sft_problems = list(task.problems("train", None, cfg.seed))
    train_problems = sft_problems[: cfg.train_problems] if cfg.train_problems else sft_problems
    if len(train_problems) < cfg.prompts_per_step:
        raise ConfigError(
            f"config key 'train_problems': {len(train_problems)} problems cannot fill "
            f"prompts_per_step={cfg.prompts_per_step}"
        )
    sft_task = task
    if cfg.sft_task and cfg.sft_steps:  # warm-start on another dataset's solutions
        sft_task = get_task(cfg.sft_task)
        sft_problems = list(sft_task.problems("train", None, cfg.seed))
    model, tokenizer = initial_policy(
        cfg, sft_task, sft_problems, run_dir, rank, resumed=resume_step is not None
    )
    rollout_init = rollout_model_path(cfg, model, tokenizer, run_dir, rank)
    if cfg.lora_rank:  # the reference is this model with the adapter disabled: no copy
        model, reference_lm = with_lora(model, cfg), None
    else:
        reference_lm = copy.deepcopy(model).requires_grad_(False).eval() if cfg.beta != 0 else None

    engine, reference = build_engines(cfg, model, reference_lm, world, device)
    rollout = build_rollout(cfg, engine.module.lm, tokenizer, rollout_init, device, rank, world)
    task = chat_prompted(cfg, task, tokenizer)
    guide = make_guide(cfg, rank)
    ctx = Context(
        cfg, engine, reference, rollout, tokenizer, task, train_problems, guide, rank, world, device
    )

    first_step = 1
    if resume_step is not None:
        first_step = checkpoint.load(engine, run_dir, guide) + 1
    rollout.sync_weights(engine.module.lm)  # the engine starts from the policy being trained
    eval_before = evaluate_once(ctx, run_dir / "eval_before.json")

    log = (
        report.MetricsLog(
            run_dir / "metrics.jsonl",
            resume_step=first_step - 1,
            tensorboard_dir=run_dir / "tensorboard" if cfg.tensorboard else None,
        )
        if rank == 0
        else None
    )
    bar = report.progress_bar(cfg.steps, first_step - 1, cfg.progress and rank == 0)
    interrupted = InterruptFlag()
    pending: list[tuple[int, dict]] = []
    step = first_step - 1
    with interrupted:
        for step in range(first_step, cfg.steps + 1):
            pending.append((step, rl_step(ctx, step)))
            bar.update(1)
            last = step == cfg.steps
            save = step % cfg.save_every == 0 or last
            if step % cfg.log_every == 0 or save:  # rows are flushed before any checkpoint
                rows = reduce_rows(pending, device)
                pending = []
                if rank == 0:
                    log.write(rows)
                    bar.set_postfix_str(report.progress_postfix(rows[-1]))
                    for row in rows:
                        if on_step is not None:
                            on_step(row["step"], row)
                stop = interrupted.agreed(device)
                if save or stop:
                    checkpoint.save(engine, run_dir, step, cfg, guide, keep=cfg.keep_checkpoints)
                if stop:
                    break
    bar.close()
    finished = step == cfg.steps and not interrupted.is_set
    eval_after = evaluate_once(ctx, run_dir / "eval_after.json") if finished else None
    if finished:
        save_final(engine, tokenizer, run_dir / "final", cfg, rank)
    summary = None
    if rank == 0:
        log.close()
        summary = write_summary(
            cfg, run_dir, step, eval_before, eval_after, time.time() - run_start, interrupted=not finished
        )
        print(report.format_summary(summary), flush=True)
    dist.barrier()
    return summary if rank == 0 else {}


def init_distributed():
    """(rank, world size, device), initialising torch.distributed through DeepSpeed once.

    Launched by torchrun / deepspeed, the environment names the rank; a bare process becomes a
    world of one on a free local port."""
    import deepspeed

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def prepare_run_dir(cfg: TrainConfig, run_dir: Path, rank: int) -> Optional[int]:
    """Create `run_dir` and save the config; with ``resume`` check the config against the saved one
    and return the newest checkpoint's step (None for a fresh run, or when there is none yet)."""
    step = checkpoint.latest_step(run_dir) if cfg.resume else None
    if step is not None:
        saved = load_yaml(run_dir / "config.yaml").to_dict()
        changed = sorted(
            k for k, v in cfg.to_dict().items() if saved.get(k) != v and k not in RESUME_MAY_CHANGE
        )
        if changed:
            raise ConfigError(
                f"resume: config key(s) {changed} differ from the run's saved config.yaml "
                f"({', '.join(f'{k}: {saved.get(k)!r} -> {getattr(cfg, k)!r}' for k in changed)})"
            )
    if rank == 0:
        if step is None and run_dir.is_dir():
            stale = [run_dir / name for name in FRESH_RUN_CLEARS if (run_dir / name).exists()]
            if stale:
                print(
                    f"sage-train: starting {run_dir} afresh (pass --resume to continue it instead)",
                    flush=True,
                )
            for path in stale:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        run_dir.mkdir(parents=True, exist_ok=True)
        save_yaml(cfg, run_dir / "config.yaml")
    dist.barrier()
    return step


def initial_policy(cfg: TrainConfig, task, train_problems: list, run_dir: Path, rank: int, *, resumed: bool):
    """The model RL starts from: `cfg.model`, warm-started by SFT when ``sft_steps > 0``.

    The warm-started model is saved to ``run_dir/sft`` (HF format); a resumed run loads it from
    there as the reference's weights (its policy weights then come from the checkpoint)."""
    sft_dir = run_dir / "sft"
    if cfg.sft_steps and resumed and (sft_dir / "config.json").is_file():
        return load_pretrained(str(sft_dir))
    model, tokenizer = load_model_and_tokenizer(cfg)
    if cfg.sft_steps:
        if torch.cuda.is_available():  # warm-start where RL will run, not on the host
            model.to(torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))))
        if cfg.lora_rank:  # the warm start trains an adapter of its own, merged in afterwards
            model = with_lora(model, cfg)
        steps = sft_warm_start(model, tokenizer, chat_prompted(cfg, task, tokenizer), train_problems, cfg)
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


def build_engines(cfg: TrainConfig, model, reference_lm, world: int, device: torch.device):
    """The DeepSpeed engine of the policy and the reference scorer (ZeRO-3-partitioned under stage 3)."""
    import deepspeed

    local_rows = check_batch_shape(cfg, world)
    ds_config = deepspeed_config(cfg, world, local_rows // cfg.micro_batch_size, device)
    policy = PolicyHead(model.to(device), cfg.loss_backend)
    trainable = [p for p in policy.parameters() if p.requires_grad]  # the adapter only under LoRA
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    total = cfg.steps * cfg.num_iterations
    engine, *_ = deepspeed.initialize(
        model=policy,
        optimizer=optimizer,
        config=ds_config,
        lr_scheduler=lambda opt: lr_schedule(opt, cfg, total),
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


def chat_prompted(cfg: TrainConfig, task, tokenizer):
    """`task` with its prompts in the tokenizer's chat template (``chat_template``), else `task`."""
    if not cfg.chat_template:
        return task
    from .tasks.math import ChatPromptTask

    return ChatPromptTask(task, tokenizer, cfg.system_prompt)


def rollout_model_path(cfg: TrainConfig, model, tokenizer, run_dir: Path, rank: int) -> str:
    """What an engine that loads weights itself (vllm) starts from: `cfg.model`, or, for a model
    built here ("tiny") or warm-started, a copy saved to ``run_dir/rollout_init`` (HF format).
    The engine then receives the policy's weights before the first step in any case."""
    if cfg.rollout_engine != "vllm":
        return cfg.model
    if cfg.model != "tiny" and not cfg.sft_steps:
        return cfg.model
    path = run_dir / "rollout_init"
    if rank == 0:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    dist.barrier()
    return str(path)


def build_rollout(cfg: TrainConfig, lm, tokenizer, model_path: str, device, rank: int, world: int):
    """The rollout engine of ``cfg.rollout_engine``, sampling from `lm` (the policy module)."""
    if cfg.rollout_engine == "hf":
        return make_engine("hf", lm, tokenizer, device=device, synced_gpus=cfg.zero_stage == 3 and world > 1)
    if cfg.rollout_engine == "vllm":
        return make_engine(
            "vllm",
            model_path,
            tokenizer,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            enable_sleep_mode=cfg.vllm_sleep_mode,
            sync_bucket_mb=cfg.vllm_sync_bucket_mb,
            max_model_len=cfg.vllm_max_model_len or None,
            dtype=cfg.vllm_dtype,
            seed=cfg.seed + rank,
        )
    shared = cfg.openai_shared_dir or str(cfg.run_dir / "adapters")
    return make_engine(
        "openai",
        cfg.openai_base_url,
        tokenizer,
        served_model=cfg.openai_model or cfg.model,
        shared_dir=os.path.join(shared, f"rank{rank}"),
        adapter_name=f"policy-rank{rank}",
    )


def check_batch_shape(cfg: TrainConfig, world: int) -> int:
    """Each rank's rows per step (its prompts x group_size); they must split into micro-batches."""
    local_rows = cfg.prompts_per_step // world * cfg.group_size
    if cfg.prompts_per_step % world or local_rows % cfg.micro_batch_size:
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


def lr_schedule(optimizer, cfg: TrainConfig, total_steps: int):
    """Linear warmup over ``warmup_steps``, then constant, cosine to 0, or linear to 0."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        if cfg.lr_schedule == "linear":
            return max(0.0, 1 - progress)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_guide(cfg: TrainConfig, rank: int):
    """The guide computed outside the loss (token, random), or None (branch lives in the loss)."""
    if cfg.guide == "token":
        return TokenGuide(
            gamma=cfg.guide_strength,
            gamma_end=cfg.guide_strength_end,
            period=cfg.guide_period,
            tau=cfg.tau,
            q_min=cfg.q_min,
            q_max=cfg.q_max,
        )
    if cfg.guide == "random":
        return RandomGuide(
            sigma=cfg.guide_strength,
            sigma_end=cfg.guide_strength_end,
            period=cfg.guide_period,
            q_min=cfg.q_min,
            q_max=cfg.q_max,
            seed=cfg.seed * 1009 + rank,
        )
    return None


def reduce_rows(pending: list[tuple[int, dict]], device: torch.device) -> list[dict]:
    """Host rows of the pending steps' metrics, averaged over ranks (q_min / q_max: min / max).

    The one host sync of the log interval: every value goes to one tensor, then `.tolist()`."""
    names = sorted(pending[0][1])
    values = torch.stack(
        [
            torch.stack(
                [torch.as_tensor(m[name], dtype=torch.float32, device=device).reshape(()) for name in names]
            )
            for _, m in pending
        ]
    )
    if dist.get_world_size() > 1:
        low, high = names.index("sage/q_min"), names.index("sage/q_max")
        minimum, maximum = values[:, low].clone(), values[:, high].clone()
        dist.all_reduce(values)
        dist.all_reduce(minimum, op=dist.ReduceOp.MIN)
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX)
        values = values / dist.get_world_size()
        values[:, low], values[:, high] = minimum, maximum
    return [{"step": step, **dict(zip(names, row))} for (step, _), row in zip(pending, values.tolist())]


class InterruptFlag:
    """SIGTERM / SIGINT set a flag (handlers installed only in the main thread); the loop checks it
    at log intervals, agreed over ranks, then checkpoints and stops."""

    def __init__(self) -> None:
        self.is_set = False
        self._previous = {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.is_set = True

    def agreed(self, device: torch.device) -> bool:
        if dist.get_world_size() == 1:
            return self.is_set
        flag = torch.tensor([1.0 if self.is_set else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.is_set = bool(flag.item())
        return self.is_set


def evaluate_once(ctx: Context, path: Path) -> Optional[dict]:
    """pass@1 and pass@k per split of ``eval_splits``, computed once (a resumed run reads the file).

    "train" samples the first ``eval_problems`` RL prompts, "test" as many held-out problems (of
    ``eval_task`` when set). Each rank evaluates an equal share of the problems (ZeRO-3 needs the
    same number of generate calls everywhere); the (n, c) counts are gathered over ranks."""
    cfg = ctx.cfg
    if cfg.eval_problems == 0 or not cfg.eval_splits:
        return None
    if path.is_file():
        return json.loads(path.read_text())
    results = {}
    for split in cfg.eval_splits:
        task = ctx.task
        if cfg.eval_task and split == "test":
            task = chat_prompted(cfg, get_task(cfg.eval_task), ctx.tokenizer)
        problems = (
            ctx.train_problems[: cfg.eval_problems]
            if split == "train"
            else list(task.problems("test", cfg.eval_problems, cfg.seed))
        )
        results[split] = pass_at_k_over_ranks(ctx, task, problems)
    if ctx.rank == 0:
        path.write_text(json.dumps(results, indent=1) + "\n")
    return results


def pass_at_k_over_ranks(ctx: Context, task, problems: list) -> dict:
    cfg = ctx.cfg
    share = len(problems) // ctx.world
    ks = sorted({1, cfg.eval_samples})
    sampling = SamplingParams(
        temperature=cfg.eval_temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        min_p=cfg.min_p,
        max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens,
        stop=tuple(cfg.stop),
    )
    result = evaluate_engine(
        ctx.rollout,
        task,
        problems[ctx.rank * share : (ctx.rank + 1) * share],
        n=cfg.eval_samples,
        ks=ks,
        sampling=sampling,
        seeds=[cfg.seed],
    )
    gathered = [None] * ctx.world
    dist.all_gather_object(gathered, [(r["n"], r["c"]) for r in result["problems"]])
    counts = [pair for part in gathered for pair in part]
    return {
        "problems": len(counts),
        "samples": cfg.eval_samples,
        **{f"pass@{k}": mean_pass_at_k(counts, k) for k in ks},
    }


def save_final(engine, tokenizer, path: Path, cfg: TrainConfig, rank: int) -> None:
    """The trained policy in HF format (model + tokenizer), loadable by AutoModelForCausalLM."""
    import deepspeed

    lm = engine.module.lm
    gather = deepspeed.zero.GatheredParameters(
        list(lm.parameters()), modifier_rank=None, enabled=cfg.zero_stage == 3
    )
    with gather:
        if rank == 0 and is_lora(lm):  # the adapter, and the merged model beside it
            lm.save_pretrained(path / "adapter")
            base_lm(lm).save_pretrained(path, state_dict=dict(merged_named_weights(lm)))
            tokenizer.save_pretrained(path)
        elif rank == 0:
            lm.save_pretrained(path)
            tokenizer.save_pretrained(path)
    dist.barrier()


def write_summary(
    cfg: TrainConfig,
    run_dir: Path,
    step: int,
    eval_before,
    eval_after,
    wall_time: float,
    *,
    interrupted: bool,
) -> dict:
    rows = report.read_metrics(run_dir / "metrics.jsonl")
    plot = report.plot_metrics(rows, run_dir / "metrics.png") if cfg.plots else None
    summary = {
        "name": cfg.name,
        "algorithm": cfg.algorithm,
        "task": cfg.task,
        "steps_done": step,
        "steps": cfg.steps,
        "interrupted": interrupted,
        "wall_time_s": wall_time,
        **report.reward_trend(rows),
        "eval_before": eval_before,
        "eval_after": eval_after,
        "run_dir": str(run_dir),
        "final_model": None if interrupted else str(run_dir / "final"),
        "plot": str(plot) if plot else None,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
