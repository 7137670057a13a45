"""The rollout-mismatch toolkit: importance weights, rejection masks and mismatch metrics between
the rollout engine's log-probs and the trainer's.

A rollout engine (vLLM) samples from numerically different log-probs than the trainer computes for
the same weights. With r_t = pi_train(y_t) / pi_rollout(y_t) (the trainer's behaviour log-probs
against the engine's):

- `truncated_is_weights` (``tis_level``, ``tis_cap``): w = min(r_t, cap) per token ("token") or with
  one weight per sequence from the *mean* log-ratio ("sequence", a geometric mean).
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
- `mismatch_metrics`: verl's rollout_corr metrics: k1 = mean(log pi_rollout - log pi_train) and k3
  over the scored tokens, and the fractions of tokens and sequences truncated, masked or rejected.

Tokens the engine could not score carry NaN log-probs (TRL's convention): their log-ratio is 0 (a
weight of 1, no evidence for the sequence's sums, never rejected) and the metrics leave them out.

Both log-probs are of the same distribution: the temperature-scaled one *before* top-k / top-p /
min-p truncation. The trainer computes exactly that; the engines report it (hf: from the raw
logits; vllm: ``raw_logprobs`` at temperature 1, as the official SAGE code does, and
``processed_logprobs`` at other temperatures, which the config only allows without truncation,
since vLLM's processed log-probs come after the cuts). The weights then correct only the
engine/trainer mismatch and are 1 where the two agree.
"""

from __future__ import annotations

import math

import torch

IS_LEVELS = ("token", "sequence")
IS_MODES = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
REJECTION_OPTIONS = tuple(
    f"{level}_{kl}" for level in ("token", "seq_sum", "seq_mean") for kl in ("k1", "k2", "k3")
) + ("seq_max_k2", "seq_max_k3")
#: verl's clamp of the log-ratio before exp in the rejection statistics
SAFETY_BOUND = 20.0


def truncated_is_weights(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *, level: str = "token", cap: float = 2.0
) -> torch.Tensor:
    """[B, L] weights min(exp(train_logp - rollout_logp), cap), 1 at masked positions; no gradient."""
    if level not in IS_LEVELS:
        raise ValueError(f"level must be one of {list(IS_LEVELS)}, got {level!r}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap!r}")
    mask = mask.bool()
    log_ratio = rollout_log_ratio(train_logp, rollout_logp, mask)
    if level == "sequence":
        count = mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = (log_ratio.sum(-1, keepdim=True) / count).expand_as(log_ratio)
    return torch.where(mask, log_ratio.exp().clamp(max=cap), 1.0)


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
    """verl's rollout_corr metrics over the scored tokens of `mask`, 0-d tensors (no host sync):
    k1, k3, the unscored fraction; with `weights` their token mean and the fraction of tokens (and
    sequences with any) truncated or masked by `mode`; with `kept` the rejected fractions."""
    mask = mask.bool()
    scored = mask & ~torch.isnan(rollout_logp)
    log_ratio = rollout_log_ratio(train_logp, rollout_logp, scored)
    tokens, n_scored = mask.sum().clamp(min=1), scored.sum().clamp(min=1)
    rows = mask.any(-1)
    n_rows = rows.sum().clamp(min=1)

    def fractions(name, flagged):
        return {
            f"rollout_corr/{name}_frac": (flagged & mask).sum() / tokens,
            f"rollout_corr/seq_{name}_frac": ((flagged & mask).any(-1) & rows).sum() / n_rows,
        }

    metrics = {
        "rollout_corr/k1": -log_ratio.sum() / n_scored,
        "rollout_corr/k3": torch.where(scored, torch.expm1(log_ratio) - log_ratio, 0.0).sum() / n_scored,
        "rollout_corr/unscored_frac": (mask & ~scored).sum() / tokens,
    }
    if weights is not None:
        metrics["rollout_corr/is_weight_mean"] = torch.where(mask, weights, 0.0).sum() / tokens
        metrics.update(fractions("truncated" if mode.endswith("truncate") else "masked", outside))
    if kept is not None:
        metrics.update(fractions("rejected", mask & ~kept))
    return metrics
