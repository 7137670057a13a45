"""The trainer's own metrics, named once: every writer of a step's row (`step`, `rl_maths`) and every
reader (the report's progress bar, plots and wall-clock filter, sage-study's curves, the benchmarks)
takes their names from `STEP_METRICS`. The names are TRL's where TRL logs the same value.

The loss's metrics (kl, entropy, ``sage/q_*``, ``clip_ratio/*``) are `sage_kernels.metrics`' table
(``METRIC_NAME``). Families whose names are built per value where they are computed, and read by no
other module, are named there: ``rollout_corr/*`` (`rl_maths.mismatch_metrics`), ``entropy/p*``
(`policy.entropy_quantiles`) and a guide's schedule values (``guide/*``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


def _wall_clock(name: str):
    """A host wall-clock time: it differs between two runs of the same seed (`WALL_CLOCK`)."""
    return field(default=name, metadata={"wall_clock": True})


@dataclass(frozen=True)
class StepMetrics:
    """A step's metrics, by the part of `step.rl_step` that computes them."""

    # the generation's, logged with each step it feeds
    reward: str = "reward"  # the verifier's mean reward
    reward_std: str = "reward_std"  # the rewards' std within a group, averaged over groups
    frac_reward_zero_std: str = "frac_reward_zero_std"  # groups whose rewards are all equal
    mean_length: str = "completions/mean_length"  # completion tokens
    min_length: str = "completions/min_length"
    max_length: str = "completions/max_length"
    clipped_ratio: str = "completions/clipped_ratio"  # completions cut by max_new_tokens
    tis_weight_mean: str = "tis/weight_mean"  # tis_level's truncated importance weights
    tis_clipped_frac: str = "tis/clipped_frac"
    tis_abs_log_ratio: str = "tis/abs_log_ratio"
    reward_kl: str = "kl_in_reward/kl"  # kl_in_reward: the completions' KL to q pi_ref
    reward_kl_penalty: str = "kl_in_reward/penalty"  # beta times it
    reward_q_mean: str = "kl_in_reward/q_mean"  # the guide q the advantage's KL used
    reward_q_above_one: str = "kl_in_reward/frac_q_gt_1"
    reward_kl_share: str = "kl_in_reward/kl_share"  # the KL part's share of the advantages
    sync_time: str = "rollout/sync_time"  # an engine holding its own weights: their last push
    sampling_rounds: str = "dynamic_sampling/rounds"
    # the update's
    num_tokens: str = "num_tokens"
    loss: str = "loss"
    q_above_one: str = "sage/frac_q_gt_1"  # the share of tokens whose anchor the loss's guide raises
    # the anchor's pull on the tokens against the task's (`pressure.pull_sums`): how strong a dose of KL
    # (and of the guide's share of it) a run trained with, measured in the run
    anchor_pressure: str = "pressure/anchor_to_task"
    guide_pressure: str = "pressure/guide_to_task"
    skipped_steps: str = "nonfinite/skipped_steps"
    learning_rate: str = "learning_rate"
    # wall clock (`step.TIMING_OF_GENERATION`)
    step_time: str = _wall_clock("step_time")
    generate_s: str = _wall_clock("timing_s/generate")
    score_s: str = _wall_clock("timing_s/score")
    update_s: str = _wall_clock("timing_s/update")


STEP_METRICS = StepMetrics()
#: the wall-clock metrics: what two runs of the same seed differ in (`report.without_timing`)
WALL_CLOCK = tuple(getattr(STEP_METRICS, f.name) for f in fields(StepMetrics) if f.metadata.get("wall_clock"))
