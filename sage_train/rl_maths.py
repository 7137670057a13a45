"""The RL maths the trainer applies, as pure tensor functions (as verl's ``core_algos`` keeps them):
the group advantages (GRPO), the importance weights and rejection masks between the rollout engine's
log-probs and the trainer's, and SAGE's objective through the advantage (the KL to q * pi_ref in the
reward). `sage_train.step` calls them; the toys of `sage_train.study` reuse them.

Group-relative advantages (GRPO, `group_advantages`): each completion is compared with the others
of its prompt.

The rollout-mismatch toolkit: importance weights, rejection masks and mismatch metrics between
the rollout engine's log-probs and the trainer's.

A rollout engine (vLLM) samples from numerically different log-probs than the trainer computes for
the same weights. With r_t = pi_train(y_t) / pi_rollout(y_t) (the trainer's behaviour log-probs
against the engine's):

- `truncated_is_weights` (``tis_level``, ``tis_cap``): w = min(r_t, cap) per token ("token") or one
  weight per sequence, the *product* of its token ratios exp(sum_t log r_t) with the sum clamped to
  [-20, 20] as verl clamps it, then capped ("sequence": verl's ``rollout_is=sequence``, TRL's
  ``sequence_truncate`` with no lower bound).
- `is_weights` (``vllm_importance_sampling_mode``, TRL 1.16's four modes and semantics):
  token_truncate w = clamp(r_t, C_min, C_max); token_mask w = r_t inside [C_min, C_max], else 0
  (with both bounds: IcePop's two-sided token mask, verl's ``rollout_is=token`` with a
  "lower_upper" threshold); sequence_truncate / sequence_mask the same with one ratio per sequence,
  the *product* exp(sum_t log r_t). A missing bound (None) does not bound.
  The weights multiply the PG term only (the loss's ``is_weights``); a masked token still counts in
  the normalisers and keeps its KL term, as in TRL.
- `rejection_mask` (``rollout_rs``, ``rollout_rs_threshold``, verl's rejection sampling): a token or
  a whole sequence whose divergence estimate exceeds its threshold leaves the loss (verl's modified
  response mask: no PG, no KL, not counted). Options, comma separated, all must pass: token_k1/k2/k3,
  seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3, over k1 = -log r, k2 = (log r)^2 / 2,
  k3 = r - 1 - log r (log r clamped to [-20, 20]); thresholds "lower_upper" bounds on exp(k1) for
  the k1 options (one number u means [1/u, u]), an upper bound for the others; one threshold for all
  options or one per option.
- `mismatch_metrics`: verl's ``rollout_corr/*`` off-policy metrics under its names
  (`sage_kernels.rollout_corr.offpolicy_metrics`: ``kl``, ``k3_kl``, the perplexities, their log
  difference and ratio, chi^2 per token and per sequence) over the scored tokens, and the fractions
  of tokens and sequences truncated, masked or rejected; `importance_metrics`: verl's
  ``rollout_corr/rollout_is_*`` statistics of the applied weights.

Tokens the engine could not score carry NaN log-probs (TRL's convention): their log-ratio is 0 (a
weight of 1, no evidence for the sequence's sums, never rejected) and the metrics leave them out.

Both log-probs are of the same distribution: the temperature-scaled one *before* top-k / top-p /
min-p truncation. The trainer computes exactly that; the engines report it (hf: from the raw
logits; vllm: ``raw_logprobs`` at temperature 1, as the official SAGE code does, and
``processed_logprobs`` at other temperatures, which the config only allows without truncation,
since vLLM's processed log-probs come after the cuts). The weights then correct only the
engine/trainer mismatch and are 1 where the two agree.

SAGE's objective through the advantage (config key ``kl_in_reward``, presets ``*-exact``).

The objective SAGE is argued from is J(pi) = E_pi[r] - beta * KL(pi || Q), Q(x) = pi_ref(x) *
prod_t q_t (docs/convergence.md). No per-token loss estimator differentiates it for a guide
that depends on the position only, but the advantage can carry it, as verl's
``use_kl_in_reward`` carries the plain KL: at generation, per completion token,

    c_t = log pi_old(y_t) - log pi_ref(y_t) - log q_t          (the k1 form)

summed over the completion (``kl_in_reward_length_normalized``: averaged over its tokens) into
c, and each completion's advantage is

    A_i = task_i - beta * (c_i - mean_j c_j)          (j over the completions of its prompt)

with task_i the verifier reward's own group advantage (`group_advantages`, scaled by its std
under ``scale_rewards`` as for any GRPO run); the loss's own beta is 0. On-policy c = log pi(x) -
log Q(x), and E_pi[c grad log pi] = grad KL(pi || Q) with Q held fixed, while a group-mean
baseline multiplies a term's expected gradient by (n - 1) / n (n completions per prompt). So the
KL part's expected gradient is exactly (n - 1)/n * (-beta grad KL(pi || Q)), in every group,
including groups whose task rewards are all equal (task_i = 0 there; the KL part is not);
with ``scale_rewards: false`` the whole advantage's is (n - 1)/n * grad J (tested on the
enumerable toy, tests/train/test_objective_gradient.py). With the task part scaled, the reward
weighs 1/std per prompt against the KL, as GRPO's with its KL in the loss, so the KL's weight
against the task is the same at the same beta in both placements.

Before issue 38 the KL was subtracted from the reward before the group statistics: the std of
r - beta c then divided the KL part too, and in a group whose task rewards were all equal the
advantages were the KL's alone divided by its own small std (not J's gradient; about 40x the
anchor pressure beta implies, measured in a rerun). Studies run before that change
(docs/results/decisive, docs/results/kl-in-reward) trained that form.

Why k1 and not k3: per prefix, E_pi[k3] = KL(pi || pi_ref) + (q - 1 - log q) for a position-only
q, and q - 1 - log q >= 0, so k3 in the reward would penalise every q != 1, where J gives the
bonus +beta log q. The length risk: that bonus is collected per token, so a completion gains
beta * sum_t log q_t, more the longer it runs through uncertain prefixes; averaging over the
completion's tokens bounds it by beta * log q_max whatever the length (and changes the
objective to E[r] - beta * E[KL(x) / |x|] when lengths differ).

q is the guide's, from the behaviour policy at generation: the branch guide from its entropy,
the token guide from its surprisal, the random guide's draw, each with its own options and
schedule (`sage_kernels.guides`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sage_kernels import rollout_corr
from sage_kernels.guides import Guide
from sage_kernels.ordered import ordered_sum

from .step_metrics import STEP_METRICS

STD_EPS = 1e-4


@dataclass(frozen=True)
class RewardSettings:
    """How a generation's rewards become advantages: `group_advantages` (``scale_rewards``) and, with
    ``kl_in_reward``, `objective_advantages` (beta times each completion's KL to q pi_ref, summed or,
    ``kl_in_reward_length_normalized``, averaged over its tokens)."""

    beta: float
    scale_rewards: bool
    kl_in_reward: bool
    kl_in_reward_length_normalized: bool


def group_advantages(rewards: torch.Tensor, *, scale: bool = True) -> torch.Tensor:
    """Advantages of rewards [G, n] (G prompts, n completions each).

    (r - mean) / (std + 1e-4) within each group, with the unbiased std as TRL computes it;
    ``scale=False`` gives r - mean (Dr. GRPO). A group whose rewards are all equal gets
    exactly zero (its mean may differ from its members by a rounding error).
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must have shape [groups, n >= 2], got {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    advantages = centred / (rewards.std(dim=1, keepdim=True) + STD_EPS) if scale else centred
    all_equal = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(advantages), advantages)


IS_LEVELS = rollout_corr.IS_LEVELS
#: ``tis_level``'s values: the level its truncated weights are taken at, or "off"
TIS_LEVELS = (*IS_LEVELS, "off")
IS_MODES = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
REJECTION_OPTIONS = tuple(
    f"{level}_{kl}" for level in ("token", "seq_sum", "seq_mean") for kl in ("k1", "k2", "k3")
) + ("seq_max_k2", "seq_max_k3")
#: verl's clamp of the log-ratio before exp in the rejection statistics
SAFETY_BOUND = 20.0


@dataclass(frozen=True)
class Corrections:
    """The rollout-mismatch corrections a run applies (`rollout_correction`), one weighting at a time:
    truncated importance sampling at ``tis_level`` (one of `TIS_LEVELS`) capped at ``tis_cap``, or
    TRL's ``vllm_importance_sampling_mode`` (one of `IS_MODES`) within its clip bounds; and verl's
    rejection (``rollout_rs``, options of `REJECTION_OPTIONS`, at ``rollout_rs_threshold``)."""

    tis_level: str
    tis_cap: float
    vllm_importance_sampling_mode: str
    vllm_importance_sampling_clip_min: float | None
    vllm_importance_sampling_clip_max: float | None
    rollout_rs: str
    rollout_rs_threshold: str | float

    @property
    def active(self) -> bool:
        return self.tis_level != "off" or self.vllm_importance_sampling_mode != "off" or bool(self.rollout_rs)


def truncated_is_weights(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *, level: str = "token", cap: float = 2.0
) -> torch.Tensor:
    """[B, L] weights min(w, cap), 1 at masked positions; no gradient. w is the token's ratio
    exp(clamp(log r_t, -20, 20)) ("token") or its sequence's product of ratios
    exp(clamp(sum_t log r_t, -20, 20)) ("sequence"), verl's `rollout_corr.raw_is_weights`."""
    if level not in IS_LEVELS:
        raise ValueError(f"level must be one of {list(IS_LEVELS)}, got {level!r}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap!r}")
    mask = mask.bool()
    raw, _ = rollout_corr.raw_is_weights(rollout_log_ratio(train_logp, rollout_logp, mask), mask, level)
    return torch.where(mask, raw.clamp(max=cap), 1.0)


def rollout_log_ratio(train_logp, rollout_logp, mask) -> torch.Tensor:
    """log pi_train - log pi_rollout where `mask` is set and the engine scored the token, else 0."""
    diff = train_logp.detach().float() - rollout_logp.float()
    return torch.where(mask.bool() & ~torch.isnan(diff), diff, 0.0)


def is_weights(log_ratio, mask, mode: str, clip_min: float | None = None, clip_max: float | None = 3.0):
    """TRL's weights of `mode` from `rollout_log_ratio` [B, L] (1 at masked positions), and the [B, L]
    bool of the tokens whose ratio lay outside [clip_min, clip_max] (truncated or masked)."""
    if mode not in IS_MODES[1:]:
        raise ValueError(f"mode must be one of {list(IS_MODES[1:])}, got {mode!r}")
    mask = mask.bool()
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    ratio = log_ratio.exp()
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    outside = ((ratio < low) | (ratio > high)) & mask
    weights = ratio.clamp(clip_min, clip_max) if mode.endswith("truncate") else ratio.masked_fill(outside, 0.0)
    return torch.where(mask, weights, 1.0), outside


def parse_rejection(options: str, thresholds) -> list[tuple[str, float, float]]:
    """`rollout_rs` and `rollout_rs_threshold` as [(option, lower, upper)] (k1 options: bounds in log
    space; others: lower -inf). Raises ValueError naming the key."""
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    bad = [o for o in names if o not in REJECTION_OPTIONS]
    if not names or bad:
        raise ValueError(f"rollout_rs must be a comma-separated list of {list(REJECTION_OPTIONS)}, got {options!r}")
    specs = [s.strip() for s in str(thresholds).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"rollout_rs_threshold must hold one threshold or one per rollout_rs option ({len(names)}), "
            f"got {thresholds!r}"
        )
    parsed = []
    for name, spec in zip(names, specs * len(names) if len(specs) == 1 else specs):
        try:
            bounds = [float(x) for x in spec.split("_")]
        except ValueError:
            bounds = []
        k1 = name.endswith("k1")
        if k1 and len(bounds) == 1 and bounds[0] > 0:
            bounds = [1.0 / bounds[0], bounds[0]]
        if not (len(bounds) == (2 if k1 else 1) and all(b > 0 for b in bounds) and bounds[0] <= bounds[-1]):
            form = "'lower_upper' or one upper bound > 0" if k1 else "one upper bound > 0"
            raise ValueError(f"rollout_rs_threshold for {name} must be {form}, got {spec!r}")
        parsed.append((name, math.log(bounds[0]), math.log(bounds[1])) if k1 else (name, -math.inf, bounds[0]))
    return parsed


def rejection_mask(log_ratio, mask, options: str, thresholds) -> torch.Tensor:
    """verl's ``compute_rollout_rejection_mask``: [B, L] bool, True where the token stays in the loss
    (a subset of `mask`)."""
    mask = mask.bool()
    m = mask.to(log_ratio.dtype)
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe * safe, "k3": torch.expm1(safe) - safe}
    keep = mask.clone()
    for name, lower, upper in parse_rejection(options, thresholds):
        level, kl = name.rsplit("_", 1)
        stat = per_token[kl]
        if level == "seq_sum":
            stat = (stat * m).sum(-1, keepdim=True)
        elif level == "seq_mean":
            stat = (stat * m).sum(-1, keepdim=True) / (m.sum(-1, keepdim=True) + 1e-8)
        elif level == "seq_max":
            stat = torch.where(mask, stat, -math.inf).amax(-1, keepdim=True).clamp(min=0.0)
        keep &= (stat >= lower) & (stat <= upper)
    return keep


def mismatch_metrics(train_logp, rollout_logp, mask, *, weights=None, outside=None, mode="off", kept=None) -> dict:
    """verl's rollout_corr off-policy metrics over the scored tokens of `mask`, 0-d tensors (no host
    sync), and the unscored fraction; with `weights` the fraction of tokens (and sequences with any)
    truncated or masked by `mode`; with `kept` the rejected fractions."""
    mask = mask.bool()
    scored = mask & ~torch.isnan(rollout_logp)
    tokens = mask.sum().clamp(min=1)
    rows = mask.any(-1)
    n_rows = rows.sum().clamp(min=1)

    def fractions(name, flagged):
        return {
            f"rollout_corr/{name}_frac": (flagged & mask).sum() / tokens,
            f"rollout_corr/seq_{name}_frac": ((flagged & mask).any(-1) & rows).sum() / n_rows,
        }

    offpolicy = rollout_corr.offpolicy_metrics(train_logp, rollout_logp, scored)
    metrics = {rollout_corr.PREFIX + name: value for name, value in offpolicy.items()}
    metrics["rollout_corr/unscored_frac"] = (mask & ~scored).sum() / tokens
    if weights is not None:
        metrics.update(fractions("truncated" if mode.endswith("truncate") else "masked", outside))
    if kept is not None:
        metrics.update(fractions("rejected", mask & ~kept))
    return metrics


def importance_metrics(log_ratio, mask, weights, level: str, upper: float | None, lower: float | None = None) -> dict:
    """verl's ``rollout_corr/rollout_is_*`` statistics (`sage_kernels.rollout_corr.is_metrics`) of the
    applied `weights` [B, L] at `level` ("token" or "sequence"), against the raw ratios of
    `rollout_log_ratio`; `upper` None: no cap. `lower` given: the IcePop lower bound (and its
    ``rollout_is_oob_ratio``)."""
    mask = mask.bool()
    raw, for_metrics = rollout_corr.raw_is_weights(log_ratio, mask, level)
    upper = math.inf if upper is None else upper
    metrics = rollout_corr.is_metrics(weights, raw, for_metrics, mask, level, upper, lower)
    return {rollout_corr.PREFIX + name: value for name, value in metrics.items()}


def rollout_correction(corrections: Corrections, engine: str, completions: list, train_logp, batch):
    """(is_weights [B, L] or None, metrics): the rollout-mismatch toolkit (this module's)
    between the rollout engine's log-probs and the trainer's, both of the temperature-scaled
    distribution before top-k / top-p / min-p truncation: ``tis_level`` or
    ``vllm_importance_sampling_mode`` weights, and ``rollout_rs`` rejection, which takes the rejected
    tokens out of ``batch.completion_mask`` (verl's modified response mask; `batch` a `policy.Batch`).
    None and no metrics when all are off or the engine returned no log-probs. A NaN engine log-prob is
    a token it could not score (weight 1, left out of the metrics); an infinite one is refused."""
    mode = corrections.vllm_importance_sampling_mode
    if not corrections.active or any(c.logprobs is None for c in completions):
        return None, {}
    rollout_logp = torch.zeros(train_logp.shape, dtype=torch.float32)  # filled on the host: no device sync
    for row, c in enumerate(completions):
        rollout_logp[row, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
    bad = torch.isinf(rollout_logp)
    if bad.any():
        row = int(bad.any(-1).nonzero()[0])
        raise ValueError(
            f"the rollout engine ({engine}) returned {int(bad.sum())} infinite log-prob(s) "
            f"(first in completion {row} of this step: {rollout_logp[row][bad[row]][:4].tolist()}); "
            "importance weights need finite log-probs of the sampled tokens (NaN marks an unscored one)"
        )
    rollout_logp = rollout_logp.to(train_logp.device)
    mask = batch.completion_mask
    log_ratio = rollout_log_ratio(train_logp, rollout_logp, mask)
    weights, outside, kept, is_metrics = None, None, None, {}
    if corrections.tis_level != "off":
        weights = truncated_is_weights(
            train_logp, rollout_logp, mask, level=corrections.tis_level, cap=corrections.tis_cap
        )
        outside = (weights >= corrections.tis_cap) & mask
        is_metrics = importance_metrics(log_ratio, mask, weights, corrections.tis_level, corrections.tis_cap)
    elif mode != "off":
        low, high = corrections.vllm_importance_sampling_clip_min, corrections.vllm_importance_sampling_clip_max
        weights, outside = is_weights(log_ratio, mask, mode, low, high)
        level, kind = mode.split("_")
        is_metrics = importance_metrics(log_ratio, mask, weights, level, high, low if kind == "mask" else None)
    if corrections.rollout_rs:
        kept = rejection_mask(log_ratio, mask, corrections.rollout_rs, corrections.rollout_rs_threshold)
    metrics = mismatch_metrics(train_logp, rollout_logp, mask, weights=weights, outside=outside, mode=mode, kept=kept)
    metrics.update(is_metrics)
    if corrections.tis_level != "off":
        tokens = mask.sum().clamp(min=1)
        metrics[STEP_METRICS.tis_weight_mean] = (weights * mask).sum() / tokens
        metrics[STEP_METRICS.tis_clipped_frac] = outside.sum() / tokens
        metrics[STEP_METRICS.tis_abs_log_ratio] = log_ratio.abs().sum() / tokens
    if kept is not None:
        batch.completion_mask = kept
    return weights, metrics


def generation_log_q(guide: Guide | None, old_logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor):
    """log q [B, L] of the behaviour policy's completions (0 where masked), or None without a guide:
    the guide given the behaviour policy's log-probs and entropies."""
    return None if guide is None else guide.log_q(old_logp, entropy, mask)


def sequence_kl(
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    log_q: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    length_normalized: bool = False,
) -> torch.Tensor:
    """[B]: sum over each completion's tokens of c_t = old_logp - ref_logp - log_q (log_q None: 0),
    or its mean over the completion's tokens (0 for a row without any). No gradient."""
    c = old_logp.detach().double() - ref_logp.detach().double()
    if log_q is not None:
        c = c - log_q.detach().double()
    total = ordered_sum(torch.where(mask, c, 0.0), -1)
    if length_normalized:
        total = total / mask.sum(-1).clamp(min=1)
    return total


def objective_advantages(
    reward: RewardSettings, guide, rewards, old_logp, entropy, ref_logp, mask
) -> tuple[torch.Tensor, dict]:
    """(advantages [G, n], metrics) under ``kl_in_reward``: the task rewards' `group_advantages`
    (``scale_rewards`` as set) minus beta times each completion's `sequence_kl` centred on its
    group's mean, never divided by a std (module docstring). Rows are the completions in group order."""
    log_q = generation_log_q(guide, old_logp, entropy, mask)
    kl = sequence_kl(old_logp, ref_logp, log_q, mask, length_normalized=reward.kl_in_reward_length_normalized)
    kl = kl.view(rewards.shape)
    advantages, kl_part = advantages_of_j(rewards.to(kl.device), kl, reward.beta, scale=reward.scale_rewards)
    tokens = mask.sum().clamp(min=1)
    q = torch.ones_like(old_logp) if log_q is None else log_q.exp()
    metrics = {
        STEP_METRICS.reward_kl: kl.mean(),  # per completion (per token with length normalisation)
        STEP_METRICS.reward_kl_penalty: reward.beta * kl.mean(),  # beta * KL, what J subtracts on average
        STEP_METRICS.reward_q_mean: torch.where(mask, q, 0.0).sum() / tokens,
        STEP_METRICS.reward_q_above_one: ((q > 1.0) & mask).sum() / tokens,
        # the KL part's share of the advantages' magnitude
        STEP_METRICS.reward_kl_share: kl_part.abs().sum() / advantages.abs().sum().clamp(min=1e-12),
    }
    return advantages.to(torch.float32), metrics


def advantages_of_j(rewards: torch.Tensor, kl: torch.Tensor, beta: float, *, scale: bool) -> tuple:
    """(advantages, KL part) [G, n] in float64 from task rewards and sequence KLs [G, n]:
    `group_advantages` of the rewards plus -beta (kl - its group mean)."""
    kl_part = -beta * (kl.double() - kl.double().mean(dim=1, keepdim=True))
    return group_advantages(rewards, scale=scale).double() + kl_part, kl_part
