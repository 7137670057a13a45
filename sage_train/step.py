"""One RL step, top to bottom: rollouts -> rewards -> group advantages -> behaviour and reference
log-probs -> the fused SAGE loss -> the optimizer step.

Normalisers. The loss of one optimizer step is that of the whole batch, over all micro-batches
and ranks: grpo and dr_grpo weight each micro-batch by its share of the step's rows; bnpo and
dapo divide by the step's completion-token count, all-reduced over ranks once per step. Each
micro-batch's backward is then scaled by the world size and not by the accumulation steps, which
undoes DeepSpeed's averaging, so the gradient does not depend on the micro-batch size.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from sage_kernels.guides import RandomGuide, TokenGuide

from .advantages import group_advantages
from .config import TrainConfig
from .distributed import all_ranks
from .importance import truncated_is_weights
from .policy import Batch, make_batch, score
from .presets import loss_config
from .rewards import grade
from .rollout import SamplingParams


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
        self.q_above_one = 0.0

    def add(self, loss: torch.Tensor, out, mask: torch.Tensor) -> None:
        tokens = mask.sum().float()
        self.loss = self.loss + loss.detach()
        self.tokens = self.tokens + tokens
        for name in self.MEAN_METRICS:
            self.sums[name] = self.sums.get(name, 0.0) + out.metrics[name].float() * tokens
        q_min, q_max = out.metrics["sage/q_min"].float(), out.metrics["sage/q_max"].float()
        # the share of tokens whose anchor the guide raises (q > 1): how much of the text it touches
        self.q_above_one = self.q_above_one + ((out.q > 1.0) & mask).sum().float()
        self.q_min = q_min if self.q_min is None else torch.minimum(self.q_min, q_min)
        self.q_max = q_max if self.q_max is None else torch.maximum(self.q_max, q_max)

    def metrics(self, iterations: int) -> dict:
        tokens = torch.as_tensor(self.tokens).clamp(min=1.0)
        means = {name: total / tokens for name, total in self.sums.items()}
        return {
            "loss": self.loss / iterations,
            **means,
            "sage/q_min": self.q_min,
            "sage/q_max": self.q_max,
            "sage/frac_q_gt_1": self.q_above_one / tokens,
        }
