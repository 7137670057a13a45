"""verl's rollout-correction diagnostics (``rollout_corr/*``), as pure tensor functions.

A rollout engine (vLLM) scores the sampled tokens with log-probs that differ numerically from the
trainer's for the same weights. verl 0.9.1 logs the gap under ``rollout_corr/`` with the names of
its ``compute_offpolicy_metrics`` and ``compute_is_metrics``; these functions return the same names,
computed as verl computes them, so that a run of ours and a run of verl read alike on one dashboard:

- `offpolicy_metrics(train_log_prob, rollout_log_prob, mask)`: ``training_ppl``,
  ``training_log_ppl``, ``kl`` (mean of log pi_rollout - log pi_train), ``k3_kl``, ``rollout_ppl``,
  ``rollout_log_ppl``, ``log_ppl_diff`` (its mean, ``_abs``, ``_max``, ``_min`` over sequences),
  ``ppl_ratio``, ``chi2_token`` (E[rho^2] - 1) and ``chi2_seq`` (E[(prod_t rho_t)^2] - 1).
- `raw_is_weights(log_ratio, mask, level)` and `is_weights(log_ratio, mask, level, upper, lower)`:
  verl's importance ratios per token ("token") or per sequence ("sequence", the *product* of the
  token ratios, exp of the sum clamped to [-20, 20]), then truncated (TIS: `upper` cap) or masked
  (IcePop: ``lower_upper``).
- `is_metrics(weights, raw_weights, log_ratio_for_metrics, mask, level, upper, lower)`:
  ``rollout_is_mean``/``_std``/``_min``/``_max``, ``rollout_is_ratio_fraction_high``/``_low``,
  ``rollout_is_eff_sample_size`` and the sequence ones (``rollout_is_seq_mean``/``_std``/``_min``/
  ``_max``/``_max_deviation``/``_fraction_high``/``_fraction_low``).
- `rollout_corr_metrics`: all of them, prefixed ``rollout_corr/``.

Every value is a 0-d tensor (no host sync); rho = pi_train / pi_rollout. Means over tokens and over
a sequence's tokens divide by (count + 1e-8) as verl's ``masked_mean`` does, so a row without tokens
counts as verl counts it (a per-sequence mean of 0). verl raises on a mask with no token; here the
token means, the extrema of the weights and the effective sample size are then 0, so a step with
nothing scored logs finite values.
"""

from __future__ import annotations

import math

import torch

#: log-ratios are clamped to [-SAFETY_BOUND, SAFETY_BOUND] before exp (verl's bound: e^20 ~ 4.9e8)
SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
PREFIX = "rollout_corr/"
_EPS = 1e-8  # verl's masked_mean denominator epsilon


def _masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    values = torch.where(mask, values, 0.0)
    return values.sum() if dim is None else values.sum(dim)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    count = mask.sum() if dim is None else mask.sum(dim)
    return _masked_sum(values, mask, dim) / (count + _EPS)


def _check(mask: torch.Tensor, **tensors) -> torch.Tensor:
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, L], got shape {tuple(mask.shape)}")
    for name, value in tensors.items():
        if value is not None and tuple(value.shape) != tuple(mask.shape):
            raise ValueError(f"{name} must have mask's shape {tuple(mask.shape)}, got {tuple(value.shape)}")
    return mask.bool()


def offpolicy_metrics(
    train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor | None, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """verl's ``compute_offpolicy_metrics`` names (unprefixed) over the tokens of `mask` [B, L];
    without `rollout_log_prob` only the training perplexities."""
    mask = _check(mask, train_log_prob=train_log_prob, rollout_log_prob=rollout_log_prob)
    train = train_log_prob.detach().float()
    train_row = _masked_mean(train, mask, -1)
    metrics = {"training_ppl": torch.exp(-train_row).mean(), "training_log_ppl": (-train_row).mean()}
    if rollout_log_prob is None:
        return metrics
    rollout = rollout_log_prob.detach().float()
    log_ratio = train - rollout
    rollout_row = _masked_mean(rollout, mask, -1)
    log_ppl_diff = rollout_row - train_row
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq_log_ratio = _masked_sum(log_ratio, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    metrics.update(
        kl=_masked_mean(-log_ratio, mask),
        k3_kl=_masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask),
        rollout_ppl=torch.exp(-rollout_row).mean(),
        rollout_log_ppl=(-rollout_row).mean(),
        log_ppl_diff=log_ppl_diff.mean(),
        log_ppl_abs_diff=log_ppl_diff.abs().mean(),
        log_ppl_diff_max=log_ppl_diff.max(),
        log_ppl_diff_min=log_ppl_diff.min(),
        ppl_ratio=torch.exp(log_ppl_diff).mean(),
        chi2_token=_masked_mean(rho.square(), mask) - 1.0,
        chi2_seq=torch.exp(2.0 * seq_log_ratio).mean() - 1.0,
    )
    return metrics


def parse_is_threshold(spec) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold``: a number u (TIS: truncate at u) or a ``"lower_upper"``
    string (IcePop: keep [lower, upper]); returns (upper, lower or None). Bad specs: ValueError
    naming the key."""
    text = str(spec).strip() if isinstance(spec, (str, int, float)) and not isinstance(spec, bool) else None
    parts = text.split("_") if text else []
    try:
        bounds = [float(p) for p in parts]
    except ValueError:
        bounds = []
    if len(bounds) not in (1, 2) or not all(math.isfinite(b) and b > 0 for b in bounds) or bounds[0] > bounds[-1]:
        raise ValueError(
            f"rollout_is_threshold must be a number > 0 or a 'lower_upper' string with 0 < lower <= upper, got {spec!r}"
        )
    return bounds[-1], (bounds[0] if len(bounds) == 2 else None)


def raw_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str):
    """verl's importance ratios before truncation from log(pi_train / pi_rollout) [B, L]: (raw weights
    [B, L], 0 off `mask`; the log-ratio its metrics read, [B, L] per token, [B, 1] per sequence).
    "token": rho_t; "sequence": one weight per row, exp(clamp(sum_t log rho_t, -20, 20)), the product
    of its token ratios."""
    if level not in IS_LEVELS:
        raise ValueError(f"level must be one of {list(IS_LEVELS)}, got {level!r}")
    mask = _check(mask, log_ratio=log_ratio)
    log_ratio = log_ratio.detach().float()
    if level == "sequence":
        log_ratio = _masked_sum(log_ratio, mask, -1).unsqueeze(-1)
    raw = torch.where(mask, torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand(mask.shape), 0.0)
    return raw, log_ratio


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, upper: float, lower: float | None = None):
    """verl's importance weights (`raw_is_weights` at `level`): (weights, raw weights, the log-ratio its
    metrics read), all 0 off `mask`. Without `lower` the raw weights are truncated at `upper` (TIS);
    with it, those outside [lower, upper] become 0 (IcePop)."""
    if not (isinstance(upper, (int, float)) and math.isfinite(upper) and upper > 0):
        raise ValueError(f"upper must be a finite number > 0, got {upper!r}")
    if lower is not None and not (isinstance(lower, (int, float)) and 0 < lower <= upper):
        raise ValueError(f"lower must be a number in (0, upper={upper}], got {lower!r}")
    raw, log_ratio = raw_is_weights(log_ratio, mask, level)
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, 0.0)
    return weights, raw, log_ratio


def is_metrics(
    weights: torch.Tensor,
    raw_weights: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    upper: float,
    lower: float | None = None,
) -> dict[str, torch.Tensor]:
    """verl's ``compute_is_metrics`` names (unprefixed) of the applied `weights` [B, L], the `raw_weights`
    before truncation or masking and `log_ratio_for_metrics` ([B, L] per token, [B, 1] per sequence,
    as `is_weights` returns them); `lower` defaults to 1 / `upper`, and with it given ``rollout_is_oob_ratio``
    (the fraction of tokens IcePop masked) joins them, as verl adds it."""
    if level not in IS_LEVELS:
        raise ValueError(f"level must be one of {list(IS_LEVELS)}, got {level!r}")
    mask = _check(mask, weights=weights, raw_weights=raw_weights)
    weights, raw = weights.detach().float(), raw_weights.detach().float()
    low = 1.0 / upper if lower is None else lower
    tokens = mask.sum()
    metrics = {"rollout_is_mean": _masked_mean(weights, mask)}
    if level == "sequence":
        row_log_ratio = log_ratio_for_metrics.detach().float()
        metrics["rollout_is_max"] = torch.exp(row_log_ratio.max().clamp(max=SAFETY_BOUND))
        metrics["rollout_is_min"] = torch.exp(row_log_ratio.min())
        # compared in log space at float32, as verl compares
        log_upper, log_low = torch.log(torch.tensor([upper, low], device=row_log_ratio.device))
        metrics["rollout_is_ratio_fraction_high"] = (row_log_ratio > log_upper).float().mean()
        metrics["rollout_is_ratio_fraction_low"] = (row_log_ratio < log_low).float().mean()
    else:
        metrics["rollout_is_ratio_fraction_high"] = _masked_mean((raw > upper).float(), mask)
        metrics["rollout_is_ratio_fraction_low"] = _masked_mean((raw < low).float(), mask)
        any_token = tokens > 0
        metrics["rollout_is_max"] = torch.where(any_token, torch.where(mask, weights, -math.inf).max(), 0.0)
        metrics["rollout_is_min"] = torch.where(any_token, torch.where(mask, weights, math.inf).min(), 0.0)
    bounded = weights.clamp(min=0.0, max=upper)
    bounded_mean = _masked_mean(bounded, mask)
    variance = (_masked_mean(bounded.square(), mask) - bounded_mean.square()).clamp(min=0.0)
    metrics["rollout_is_std"] = torch.where(tokens > 1, variance.sqrt(), 0.0)
    normalised = bounded / (bounded_mean + _EPS)
    ess = 1.0 / _masked_mean(normalised.square(), mask)
    metrics["rollout_is_eff_sample_size"] = torch.where(tokens > 0, ess, 0.0)
    row_mean = _masked_mean(weights, mask, -1)
    raw_row_mean = _masked_mean(raw, mask, -1)
    metrics.update(
        rollout_is_seq_mean=row_mean.mean(),
        rollout_is_seq_std=row_mean.std() if row_mean.numel() > 1 else row_mean.new_zeros(()),
        rollout_is_seq_max=row_mean.max(),
        rollout_is_seq_min=row_mean.min(),
        rollout_is_seq_max_deviation=(row_mean - 1.0).abs().max(),
        rollout_is_seq_fraction_high=(raw_row_mean > upper).float().mean(),
        rollout_is_seq_fraction_low=(raw_row_mean < low).float().mean(),
    )
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = _masked_mean(((raw < lower) | (raw > upper)).float(), mask)
    return metrics


def rollout_corr_metrics(
    train_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str | None = None,
    upper: float = 2.0,
    lower: float | None = None,
) -> dict[str, torch.Tensor]:
    """``rollout_corr/<name>``: `offpolicy_metrics` and, with a `level`, the `is_metrics` of verl's
    weights at that level (`is_weights`), as verl's ``compute_rollout_correction_and_rejection_mask``
    logs them."""
    metrics = {}
    if level is not None:
        log_ratio = train_log_prob.detach().float() - rollout_log_prob.detach().float()
        weights, raw, for_metrics = is_weights(log_ratio, mask, level, upper, lower)
        metrics.update(is_metrics(weights, raw, for_metrics, mask, level, upper, lower))
    metrics.update(offpolicy_metrics(train_log_prob, rollout_log_prob, mask))
    return {PREFIX + name: value for name, value in metrics.items()}
