"""One RL step, top to bottom: rollouts -> rewards -> behaviour and reference log-probs -> group
advantages (with ``kl_in_reward``, the reward's plus J's KL part, minus beta times the KL to q
pi_ref centred per group: `sage_train.rl_maths`) -> the fused SAGE loss -> the optimizer step.

Normalisers. The loss of one optimizer step is that of the whole batch, over all micro-batches
(TRL's with the step as one local batch and no accumulation) and ranks: grpo and dr_grpo weight
each micro-batch by its share of the step's rows; dapo, cispo and vespo divide by the step's
completion-token count, all-reduced over ranks once per step; bnpo divides by this rank's count
and weights each rank equally (TRL's local-batch mean, averaged over processes). Each
micro-batch's backward is then scaled by the world size and not by the accumulation steps, which
undoes DeepSpeed's averaging, so the gradient does not depend on the micro-batch size.

Generations. With ``steps_per_generation`` k > 1 (TRL's option; the official SAGE runs use 2) one
generation samples ``prompts_per_step x k`` prompts, scores them once (behaviour and reference
log-probs, importance weights) and feeds k optimizer steps, its rows shuffled and dealt out in k
equal parts: the steps after the first are off-policy by the updates before them, so the clipped
ratio is active there. The generation's reward and length metrics are logged with each of its
steps. A run resumed in the middle of a generation samples that generation again (same prompts
and seeds, from the resumed weights).
"""

from __future__ import annotations

import random
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from sage_kernels.loss_types import LOSS_TYPES
from sage_kernels.metrics import EXTREME_METRICS, MEAN_METRICS

from . import pressure
from .context import Generation, RunContext
from .distributed import all_ranks
from .micro_batches import split
from .policy import Batch, entropy_quantiles, make_batch, score
from .report import write_completions
from .rl_maths import group_advantages, objective_advantages, rollout_correction
from .rollout import SamplingParams
from .run_files import RUN_FILES
from .step_metrics import STEP_METRICS
from .tasks import grade

#: host wall-clock seconds of a step's parts (on CUDA, without a synchronise: kernels still queued
#: count toward the next part): sampling with grading, scoring (behaviour + reference log-probs),
#: the loss + backward + optimizer step. A step fed by an earlier generation logs 0 for its parts.
TIMING_OF_GENERATION = (STEP_METRICS.generate_s, STEP_METRICS.score_s)


def rl_step(ctx: RunContext, step: int) -> dict:
    """One RL optimizer step (and, when it starts a generation, the rollouts of that generation);
    returns its metrics (tensors stay on the device, no host sync)."""
    shape, start = ctx.settings.step, time.perf_counter()
    spg = shape.steps_per_generation
    first = step - (step - 1) % spg  # steps first .. first + spg - 1 share one generation
    timing = dict.fromkeys(TIMING_OF_GENERATION, 0.0)  # a step fed by an earlier generation spent none
    if ctx.generation is None or ctx.generation.first_step != first:  # a resumed run regenerates
        ctx.generation = generate(ctx, first)
        timing = ctx.generation.timing
    gen = ctx.generation
    part = gen.batch.rows // spg
    rows = gen.order[(step - first) * part : (step - first + 1) * part]
    batch = Batch(
        **{name: value[rows] if isinstance(value, torch.Tensor) else value for name, value in vars(gen.batch).items()}
    )

    # 5. the guide the loss calls (`PolicyHead`, per micro-batch, with the current policy's log-probs
    # and entropies): none when the loss computes its own (branch) or, with kl_in_reward, when the
    # guide and the KL were in the reward at generation and the loss has neither.
    in_reward = ctx.settings.reward.kl_in_reward
    in_loss = ctx.guide is not None and ctx.guide.loss_option == "none" and not in_reward

    # 6. the loss on hidden states + LM head, micro-batch by micro-batch, then the optimizer step
    update_start = time.perf_counter()
    totals = policy_update(
        ctx,
        batch,
        gen.advantages[rows],
        gen.old_logp[rows],
        None if gen.ref_logp is None or in_reward else gen.ref_logp[rows],
        ctx.guide if in_loss else None,
        None if gen.is_weights is None else gen.is_weights[rows],
    )

    update_s = time.perf_counter() - update_start
    check_finite_steps(ctx, step, totals.skipped)

    # 6b. the next generation (or the final evaluation) samples from the updated weights (hf: the
    # live model already)
    if step == first + spg - 1 or step == shape.steps:
        ctx.rollout.sync_weights(ctx.engine.module.lm)

    # 7. metrics, still tensors; converted at log intervals
    metrics = {
        **gen.metrics,
        STEP_METRICS.num_tokens: batch.attention_mask.sum().float(),
        **totals.metrics(shape.num_iterations),
        STEP_METRICS.learning_rate: ctx.engine.get_lr()[0],
        STEP_METRICS.step_time: time.perf_counter() - start,
        **timing,
        STEP_METRICS.update_s: update_s,
    }
    if ctx.guide is not None:
        metrics.update(ctx.guide.schedule_values())
    return metrics


def generate(ctx: RunContext, first_step: int) -> Generation:
    """The rollouts of the generation starting at `first_step`, graded, with their advantages and
    their behaviour / reference log-probs; its rows shuffled (seeded by the step, so identically
    on a resumed run)."""
    shape, reward = ctx.settings.step, ctx.settings.reward

    # 1. rollouts and rewards: group_size completions per prompt, graded by the task's verifier
    start = time.perf_counter()
    groups, rewards, rounds = collect_groups(ctx, first_step)
    sampled = time.perf_counter()
    completions = [c for group in groups for c in group["completions"]]

    # 2. the batch; DAPO's overlong filtering drops completions cut by max_new_tokens from the loss
    batch = make_batch(completions, ctx.device, ctx.tokenizer.pad_token_id)
    truncated = torch.tensor([c.finish_reason == "length" for c in completions], device=ctx.device)
    if shape.overlong_filter:
        batch.completion_mask &= ~truncated[:, None]

    # 3. behaviour and reference log-probs (no gradient), fixed for the whole generation
    micro_batches = step_micro_batches(ctx, batch)
    old_logp, entropy = score(ctx.engine, batch, micro_batches, shape.temperature)
    engine = ctx.settings.rollout.rollout_engine
    is_weights, tis_metrics = rollout_correction(ctx.settings.corrections, engine, completions, old_logp, batch)
    ref_logp = score(ctx.reference, batch, micro_batches, shape.temperature)[0] if ctx.reference is not None else None
    timing = dict(zip(TIMING_OF_GENERATION, (sampled - start, time.perf_counter() - sampled)))

    # 4. group advantages: (r - mean) / (std + 1e-4) within each prompt's group, of the verifier's
    # reward; with kl_in_reward, plus -beta (c - mean c) of each completion's KL c to q pi_ref
    advantages, kl_metrics = group_advantages(rewards, scale=reward.scale_rewards), {}
    if reward.kl_in_reward:
        args = (rewards, old_logp, entropy, ref_logp, batch.completion_mask)
        advantages, kl_metrics = objective_advantages(reward, ctx.guide, *args)
    advantages = advantages.flatten().to(ctx.device)

    lengths = batch.completion_mask.new_tensor([len(c.completion_ids) for c in completions], dtype=torch.float32)
    metrics = {
        STEP_METRICS.reward: rewards.mean(),
        STEP_METRICS.reward_std: rewards.std(dim=1).mean(),
        STEP_METRICS.frac_reward_zero_std: (rewards.std(dim=1) == 0).float().mean(),
        STEP_METRICS.mean_length: lengths.mean(),
        STEP_METRICS.min_length: lengths.min(),
        STEP_METRICS.max_length: lengths.max(),
        STEP_METRICS.clipped_ratio: truncated.float().mean(),
        **tis_metrics,
        **kl_metrics,
        **entropy_quantiles(entropy, batch.completion_mask),
    }
    if getattr(ctx.rollout, "last_sync_s", None) is not None:  # engines holding their own weights
        metrics[STEP_METRICS.sync_time] = ctx.rollout.last_sync_s
    if shape.dynamic_sampling:
        metrics[STEP_METRICS.sampling_rounds] = float(rounds)
    shuffle = torch.Generator().manual_seed(rollout_seed(shape.seed, first_step, 0, ctx.rank))
    order = (
        torch.randperm(batch.rows, generator=shuffle) if shape.steps_per_generation > 1 else torch.arange(batch.rows)
    )
    return Generation(
        first_step, batch, advantages, old_logp, ref_logp, is_weights, order.to(ctx.device), metrics, timing
    )


def check_finite_steps(ctx: RunContext, step: int, skipped: list[str]) -> None:
    """Say which optimizer steps were skipped; after ``max_nonfinite_steps`` RL steps in a row with
    one, set ``ctx.stop`` (the loop logs the step, then stops: the weights are still those of the
    last good step, which the last checkpoint holds)."""
    if not skipped:
        ctx.nonfinite_in_a_row = 0
        return
    ctx.nonfinite_in_a_row += 1
    if ctx.rank == 0:
        print(f"sage-train: step {step}: optimizer step skipped ({', '.join(skipped)})", flush=True)
    if ctx.nonfinite_in_a_row >= ctx.settings.step.max_nonfinite_steps:
        ctx.stop = (
            f"steps {step - ctx.nonfinite_in_a_row + 1}..{step} all had a non-finite loss or gradient "
            f"(max_nonfinite_steps={ctx.settings.step.max_nonfinite_steps}); stopped with the weights of the last good "
            f"step, which the last checkpoint holds. Lower lr or beta, then continue with --resume"
        )


def policy_update(ctx: RunContext, batch: Batch, advantages, old_logp, ref_logp, guide, is_weights=None) -> LossTotals:
    """``num_iterations`` optimizer steps on the batch, each accumulated over micro-batches.
    `guide` (a `Guide` or None) is called by the loss forward of each micro-batch (`PolicyHead`).

    The normalisers are the whole step's, over all micro-batches and ranks (module docstring),
    so the gradient does not depend on how the rows are split. The guide steps once per optimizer step.
    """
    shape = ctx.settings.step
    loss_cfg, row_share = step_loss_config(ctx, batch)
    micro_batches, totals = step_micro_batches(ctx, batch), LossTotals()
    # each token's advantage on the step's grid, so a packed micro-batch takes its tokens' (`add_pressure`)
    token_advantages = advantages[:, None].expand(batch.completion_mask.shape) if advantages.dim() == 1 else advantages
    for _ in range(shape.num_iterations):
        step_loss, why = 0.0, None
        for index, micro in enumerate(micro_batches):
            loss_inputs = {
                "mask": micro.tokens(batch.completion_mask),
                "advantages": advantages[micro.rows],
                "old_logp": micro.tokens(old_logp),
                "ref_logp": None if ref_logp is None else micro.tokens(ref_logp),
                "guide": guide,
                "is_weights": None if is_weights is None else micro.tokens(is_weights),
                "config": loss_cfg,
            }
            # the optimizer steps after the last micro-batch, however many the token budget made
            ctx.engine.set_gradient_accumulation_boundary(index == len(micro_batches) - 1)
            loss, out = ctx.engine(**micro.model_inputs(batch, shape.temperature), loss_inputs=loss_inputs)
            loss = loss * row_share(micro.size)
            ctx.engine.backward(loss * ctx.world, scale_wrt_gas=False)  # undo DeepSpeed's averaging
            step_loss = step_loss + loss.detach()
            if ctx.engine.is_gradient_accumulation_boundary():
                why = nonfinite_step(ctx, step_loss)
            with skipped_update(ctx.engine, why is not None):
                ctx.engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
            totals.add(loss, out, loss_inputs["mask"])
            totals.add_pressure(out, {**loss_inputs, "advantages": micro.tokens(token_advantages)}, loss_cfg)
        if not ctx.engine.was_step_applied():
            totals.skipped.append(why or "non-finite gradient (DeepSpeed's overflow check)")
        if ctx.guide is not None:
            ctx.guide.step()
    return totals


def step_micro_batches(ctx: RunContext, batch: Batch) -> list:
    """The run's micro-batches of `batch` (`sage_train.micro_batches`): its rows or token budget, its layout."""
    rows, budget = ctx.settings.step.micro_batch_size, ctx.settings.step.max_tokens_per_micro_batch
    return split(batch, rows=rows, max_tokens=budget, packed=ctx.padding_free, world=ctx.world)


def nonfinite_step(ctx: RunContext, step_loss: torch.Tensor) -> str | None:
    """At the accumulation boundary, before the optimizer step: why that step must be skipped (a
    non-finite loss, or gradient norm, on any rank), or None. One host sync per optimizer step.
    The gradient norm is checked here for a plain torch optimizer (ZeRO stage 0 in float32), which
    would apply it; DeepSpeed's own optimizers (ZeRO, bf16) check their gradients and skip the step
    themselves (``was_step_applied()`` then reads false; a non-finite loss whose gradients they find
    finite is applied by them, as this cannot reach into their partitioned gradients)."""
    grads = [p.grad for p in ctx.engine.module.parameters() if p.grad is not None]
    values = [torch.as_tensor(step_loss, device=ctx.device).float()]
    if isinstance(ctx.engine.optimizer, torch.optim.Optimizer) and grads:
        values.append(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])))
    bad = (~torch.isfinite(torch.stack(values))).float()
    if ctx.world > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    flags = bad.tolist()
    if flags[0]:
        return "non-finite loss"
    return "non-finite gradient norm" if any(flags) else None


@contextmanager
def skipped_update(engine, skip: bool):
    """Around ``engine.step()``: when `skip`, the step leaves the parameters and the optimizer state
    as they are. Its gradients are zeroed (DeepSpeed's clipping needs them present) and the optimizer's
    ``step`` is a no-op for this call; ``overflow`` makes DeepSpeed count the step as skipped (no
    LR-scheduler step, ``was_step_applied()`` false), as it does for its own optimizers' overflows."""
    optimizer = engine.optimizer
    if not skip or not isinstance(optimizer, torch.optim.Optimizer):
        yield
        return
    for p in engine.module.parameters():
        if p.grad is not None:
            p.grad.zero_()
    optimizer.overflow = True
    wrapped = optimizer.__dict__.get("step")  # the LR scheduler's wrapper of the method, if any
    optimizer.step = lambda closure=None: None  # for this call only
    try:
        yield
    finally:
        if wrapped is None:
            del optimizer.step
        else:
            optimizer.step = wrapped
        optimizer.overflow = False


def collect_groups(ctx: RunContext, step: int):
    """This rank's groups for the generation starting at `step` (``prompts_per_step x
    steps_per_generation`` prompts over all ranks): [{"problem", "completions", "rewards"}],
    rewards [G, n], rounds.

    With dynamic sampling (DAPO) only groups with mixed rewards are kept and more prompts are
    drawn to replace the others, for at most ``dynamic_sampling_max_rounds`` rounds; if the cap
    is hit, uninformative groups fill the batch (their advantages are zero), so every step has
    the same shape. All ranks run the same number of rounds (ZeRO-3 needs matching generate calls).
    """
    shape = ctx.settings.step
    prompts = shape.prompts_per_step * shape.steps_per_generation
    needed = prompts // ctx.world
    informative, uninformative = [], []
    rounds = 0
    with ctx.rollout.awake():  # the rounds of one step share one wake (vllm: one weight push)
        while True:
            problems = step_problems(ctx.train_problems, shape.seed, step, rounds, prompts)[ctx.rank :: ctx.world]
            params = SamplingParams.for_rollouts(ctx.settings.rollout, rollout_seed(shape.seed, step, rounds, ctx.rank))
            outputs = ctx.rollout.generate([ctx.task.prompt(p) for p in problems], params)
            for problem, completions in zip(problems, outputs):
                scores = grade(ctx.task, [c.text for c in completions], problem)
                group = {"problem": problem, "completions": completions, "rewards": scores}
                (informative if len(set(scores)) > 1 or not shape.dynamic_sampling else uninformative).append(group)
            rounds += 1
            if not shape.dynamic_sampling:
                break
            done = len(informative) >= needed or rounds >= shape.dynamic_sampling_max_rounds
            if all_ranks(done, ctx.device):
                break
    groups = (informative + uninformative)[:needed]
    if shape.log_completions and ctx.rank == 0:
        path = ctx.settings.run.run_dir / RUN_FILES.completions
        write_completions(path, step, groups[: shape.log_completions], ctx.task.prompt)
    rewards = torch.tensor([g["rewards"] for g in groups], dtype=torch.float32)
    return groups, rewards, rounds


def step_problems(pool: list, seed: int, step: int, round_: int, count: int) -> list:
    """The prompts of (step, round), the same on every rank: the data position is the step."""
    rng = random.Random(f"{seed}:{step}:{round_}")
    return [pool[i] for i in rng.sample(range(len(pool)), count)]


def rollout_seed(seed: int, step: int, round_: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 1009 + round_ * 101 + rank) % (2**31)


def step_loss_config(ctx: RunContext, batch: Batch):
    """The step's LossConfig and `row_share(rows)`, the factor of a micro-batch of `rows` rows' loss.

    grpo, sapo, luspo and dr_grpo: a micro-batch counts for its rows over the step's rows
    (prompts_per_step x group_size). The token-count types get a count (0-d: no host sync) and
    micro-batches add up: dapo, cispo and vespo the step's over all ranks (one all-reduce); bnpo,
    which would divide by each call's own count, becomes dapo given this rank's count, each rank
    weighted 1 / world (TRL: each process's local-batch mean, averaged over processes).
    """
    base = ctx.loss
    normaliser = LOSS_TYPES[base.loss_type].normaliser
    if normaliser == "given_tokens" or normaliser == "call_tokens":
        tokens = batch.completion_mask.sum().float()
        share = 1.0
        if normaliser == "given_tokens" and ctx.world > 1:
            dist.all_reduce(tokens)
        if normaliser == "call_tokens":
            base, share = base.replace(loss_type="dapo"), 1.0 / ctx.world
        return base.replace(num_items_in_batch=tokens.clamp(min=1.0)), lambda rows: share
    total_rows = ctx.settings.step.prompts_per_step * ctx.settings.step.group_size
    return base, lambda rows: rows / total_rows


class LossTotals:
    """Sums of the loss and of the loss's metrics over micro-batches, token-weighted; of the loss's min
    and max metrics (`EXTREME_METRICS`), the min and the max."""

    def __init__(self) -> None:
        self.loss, self.tokens, self.sums = 0.0, 0.0, {}
        self.extremes = dict.fromkeys(EXTREME_METRICS)  # None until a micro-batch
        self.skipped: list[str] = []  # why each skipped optimizer step was skipped
        self.q_above_one = 0.0
        self.pull = None  # {"task", "anchor", "guide"}: summed |coefficients| (`add_pressure`); None without KL

    def add(self, loss: torch.Tensor, out, mask: torch.Tensor) -> None:
        tokens = mask.sum().float()
        self.loss = self.loss + loss.detach()
        self.tokens = self.tokens + tokens
        for name in MEAN_METRICS:  # a micro-batch without tokens has NaN metrics: it adds nothing
            self.sums[name] = self.sums.get(name, 0.0) + torch.nan_to_num(out.metrics[name].float() * tokens)
        # the share of tokens whose anchor the guide raises (q > 1): how much of the text it touches
        self.q_above_one = self.q_above_one + ((out.q > 1.0) & mask).sum().float()
        for name, reduction in EXTREME_METRICS.items():
            value, seen = out.metrics[name].float(), self.extremes.get(name)
            keep = torch.fmin if reduction == "min" else torch.fmax  # fmin/fmax skip NaN
            self.extremes[name] = value if seen is None else keep(seen, value)

    def add_pressure(self, out, inputs: dict, config) -> None:
        """Adds the micro-batch's `pressure.pull_sums` (the task's, the anchor's and the guide's pull)."""
        sums = pressure.pull_sums(out, inputs, config)
        if sums is not None:
            self.pull = sums if self.pull is None else {name: self.pull[name] + sums[name] for name in sums}

    def metrics(self, iterations: int) -> dict:
        """The step's metrics; the token means are NaN (no value, which the report leaves out) when
        the step had no completion token."""
        tokens = torch.as_tensor(self.tokens)
        means = {
            name: torch.where(tokens > 0, total / tokens.clamp(min=1.0), torch.nan) for name, total in self.sums.items()
        }
        return {
            STEP_METRICS.loss: self.loss / iterations,
            **means,
            **self.extremes,
            STEP_METRICS.skipped_steps: float(len(self.skipped)),
            STEP_METRICS.q_above_one: torch.where(tokens > 0, self.q_above_one / tokens.clamp(min=1.0), torch.nan),
            **pressure.pressure_metrics(self.pull),
        }
