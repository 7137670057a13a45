"""The SAGE loss of ``docs/loss.md`` in plain PyTorch: the oracle every backend is tested against.

It materialises the [N, V] logits, so it is for tests, benchmarks ("naive") and small
problems. Gradients come from autograd. Run it in float64 for a ground truth. It is also
``backend="reference"``: `sage_loss` and `logprobs_and_entropy`, the backend interface.

The per-token stage (`token_stage`) is a function of the per-token log-probs and
entropies only; the chunked CPU path reuses it (it is O(N) work) and differentiates it
with autograd to get g = dloss/dlogp and c = dloss/dH.

Choices where TRL leaves room (docs/loss.md lists them all), following TRL's GRPOTrainer:
- old_logp None: ratio = exp(logp - logp.detach()) (1, with gradient).
- delta_clip caps only the unclipped ratio; the clipped one is clamped from the raw ratio.
- clip fractions use the (delta-capped) ratio: low = r < 1 - eps_low and A < 0,
  high = r > 1 + eps_high and A > 0, region = either.
- the entropy quantile uses torch.quantile's linear interpolation over this call's
  unmasked positions (TRL gathers across processes first).
- the KL is computed whenever ref_logp is given (for the metric) and enters the loss only
  when beta != 0; with use_bias_correction_kl the reported KL is the ratio-weighted one.
- cispo's clip fraction is TRL's ``cispo_clip_ratio`` (r > eps_high and A > 0), reported as
  clip_ratio/high_mean and region_mean; sapo and vespo clip nothing (all three are 0).
- dppo_tv and dppo_kl follow verl's ``compute_policy_loss_dppo_tv/kl``: a token whose trust region
  binds (`dppo_trust_region`) is dropped from the PG term; verl's pg_clipfrac, the fraction of
  such tokens, is clip_ratio/region_mean (low: A <= 0, high: A > 0, as verl splits the sides). verl
  clamps the log-ratio to [-20, 20] before exp; below the cap e^20 that changes nothing.
- gmpo follows the official GMPO code (`gmpo_ratio`): its clip fractions count the tokens whose
  log-ratio clip binds (their gradient is cut): low = log r < -eps_low and A < 0, high =
  log r > eps_high and A > 0; the per-token ``ratio`` output stays the token ratio r.
- the off-policy mask multiplies the PG term only (TRL's order: the KL and the entropy bonus
  of a dropped sequence stay), and the normalisers still count its tokens.
- a call without any unmasked token has no metric values: every metric is NaN (its loss is 0).
"""

from __future__ import annotations

import math

import torch

from .guides import branch_guide
from .inputs import REFERENCE_DTYPES, SageInputs, SageLossOutput
from .loss_types import LOSS_TYPES
from .metrics import METRICS, reduce_masked
from .ordered import ordered_sum
from .packing import layout_of
from .spec import LossConfig


def logits_of(
    hidden2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    dtype: torch.dtype,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """z = s (h W^T + b) / T, or c tanh(s (h W^T + b) / c) / T with a softcap c, in `dtype` (the
    [N, V] tensor the fast paths never build); HF's order (scale, softcap), then TRL's temperature."""
    z = hidden2d.to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        z = z + bias.to(dtype)
    z = z * logit_scale
    if logit_softcap is not None:
        z = logit_softcap * torch.tanh(z / logit_softcap)
    return z / temperature


def reference_logprobs_and_entropy(
    hidden2d,
    weight,
    token_ids_flat,
    *,
    bias=None,
    temperature=1.0,
    logit_scale=1.0,
    logit_softcap=None,
    dtype=torch.float32,
):
    """logp[y] and entropy H (nats) per row of `hidden2d`, differentiable."""
    z = logits_of(hidden2d, weight, bias, temperature, dtype, logit_scale, logit_softcap)
    logprobs = torch.log_softmax(z, dim=-1)
    logp = logprobs.gather(-1, token_ids_flat[:, None]).squeeze(-1)
    # a logit of -inf (a finfo.min bias over T < 1 overflows) has p = 0 and p log p = 0, not 0 * -inf = NaN
    finite = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)
    entropy = -ordered_sum(finite.exp() * finite, -1)
    return logp, entropy


def kl_estimate(delta: torch.Tensor, kl: str) -> torch.Tensor:
    """Per-token KL estimate from delta = log anchor - log pi at a token sampled from pi.

    k1, k2, k3 (Schulman's) estimate the reverse KL(pi || anchor). fk3 = r*delta - (r - 1) with
    r = anchor/pi = exp(delta) estimates the forward KL(anchor || pi): E_pi[r log r] is that KL
    and E_pi[r - 1] = 0 is a control variate; it is >= 0 like k3 (our choice for grpo-forward-kl).
    "k1+" and "k3+" are verl's straight-through estimators: k1's or k3's value, k2's gradient (k2's
    expected gradient is the reverse KL's; k1's and k3's are not).
    """
    if kl.endswith("+"):
        k2 = 0.5 * delta * delta
        return kl_estimate(delta, kl[:-1]).detach() + (k2 - k2.detach())
    if kl == "k1":
        return -delta
    if kl == "k2":
        return 0.5 * delta * delta
    if kl == "fk3":
        return torch.exp(delta) * delta - torch.expm1(delta)
    return torch.expm1(delta) - delta


def off_policy_keep(logp, behaviour_logp, A, mask, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's ``get_off_policy_mask``): True where A >= 0 or
    the sequence's mean of behaviour_logp - logp over its unmasked tokens is at most `threshold`.

    logp: [B, L] (its gradient is not followed); behaviour_logp: [B, L], NaN where the sampler could
    not score a token (it then adds 0); A: [B, L]; mask: [B, L] bool. Returns [B, L] bool.
    """
    m = mask.to(logp.dtype)
    evidence = mask & ~torch.isnan(behaviour_logp)
    kl = torch.where(evidence, behaviour_logp - logp.detach(), 0.0)
    mean_kl = ordered_sum(kl, -1, keepdim=True) / ordered_sum(m, -1, keepdim=True).clamp(min=1.0)
    return (A >= 0) | (mean_kl <= threshold)


def token_stage(logp: torch.Tensor, entropy: torch.Tensor, inputs: SageInputs, config: LossConfig):
    """Everything after the vocabulary sweep, on [B, L] tensors.

    Returns (loss, per_token) where per_token holds detached q, kl, ratio and the metrics.
    Differentiable in `logp` and `entropy`; the guide is a constant. The per-token values are
    formed where `inputs.loss_mask` is set; the completion mask alone drives the sequence-level
    ratio, the entropy quantile's threshold, the luspo row weights and the metrics.
    """
    mask, active = inputs.mask, inputs.loss_mask
    B, L = inputs.shape
    m = mask.to(logp.dtype)
    logp = torch.where(active, logp, 0.0)
    entropy = torch.where(active, entropy, 0.0)
    A = inputs.advantages.to(logp.dtype)

    if inputs.log_q is not None:
        log_q = inputs.log_q.to(logp.dtype)
    elif config.guide == "branch":
        q = branch_guide(entropy, gamma=config.gamma, tau=config.tau, q_min=config.q_min, q_max=config.q_max)
        log_q = torch.where(active, q.log(), 0.0)
    else:
        log_q = torch.zeros_like(logp)

    if inputs.ref_logp is not None:
        delta = inputs.ref_logp.to(logp.dtype) + log_q - logp
        if config.kl_clamp is not None:  # the opt-in overflow guard: no gradient outside the bounds
            delta = delta.clamp(-config.kl_clamp, config.kl_clamp)
        kl = torch.where(active, kl_estimate(delta, config.kl), 0.0)
    else:
        kl = torch.zeros_like(logp)

    old_logp = logp.detach() if inputs.old_logp is None else inputs.old_logp.to(logp.dtype)
    token_log_ratio = logp - old_logp
    log_ratio = token_log_ratio
    if config.importance_sampling == "sequence":
        row_sum = ordered_sum(log_ratio * m, -1, keepdim=True)
        log_ratio = (row_sum / ordered_sum(m, -1, keepdim=True).clamp(min=1.0)).expand(B, L)
    ratio = torch.exp(log_ratio)
    if config.use_bias_correction_kl:
        kl = kl * ratio
    pg, low, high = policy_gradient_term(logp, ratio, token_log_ratio, A, inputs, config)
    if config.off_policy_mask_threshold is not None:
        behaviour = old_logp if inputs.sampling_logp is None else inputs.sampling_logp.to(logp.dtype)
        keep = off_policy_keep(logp, behaviour, A, mask, config.off_policy_mask_threshold)
        pg = pg * keep.to(pg.dtype)
    if config.top_entropy_quantile < 1.0:
        pg = pg * high_entropy_mask(entropy, mask, config.top_entropy_quantile, active).to(pg.dtype)
    if (
        inputs.is_weights is not None and not LOSS_TYPES[config.loss_type].sequence_weight
    ):  # else w is in the row weight
        pg = pg * inputs.is_weights.to(pg.dtype)

    per_token_loss = pg - config.entropy_coef * entropy
    if config.beta != 0:
        per_token_loss = per_token_loss + config.beta * kl
    loss = aggregate(per_token_loss, m, config)

    q = torch.where(active, log_q.detach().exp(), 1.0)
    values = {"kl": kl.detach(), "entropy": entropy.detach(), "q": q, "low": low, "high": high, "region": low | high}
    values = {name: value.to(q.dtype) for name, value in values.items()}
    # no token, no value: NaN, which the loggers skip (a 0 or a 1 would read as a measurement)
    metrics = {
        metric.name: torch.where(mask.any(), reduce_masked(values[metric.value], mask, metric.reduction), float("nan"))
        for metric in METRICS
    }
    per_token = {"q": q, "kl": kl.detach(), "ratio": torch.where(active, ratio.detach(), 1.0), "metrics": metrics}
    return loss, per_token


def policy_gradient_term(logp, ratio, token_log_ratio, A, inputs: SageInputs, config: LossConfig):
    """The per-token PG term of `config.loss_type` and its (low, high) clip indicators."""
    none = torch.zeros_like(inputs.mask)
    if config.loss_type == "cispo":
        pg = -ratio.clamp(max=config.eps_high).detach() * A * logp
        return pg, none, (ratio > config.eps_high) & (A > 0)
    if config.loss_type == "sapo":
        temperature = _by_sign(A > 0, config.sapo_temperature_pos, config.sapo_temperature_neg, ratio)
        return -torch.sigmoid(temperature * (ratio - 1.0)) * (4.0 / temperature) * A, none, none
    if config.loss_type == "vespo":
        phi = vespo_weight(token_log_ratio.detach(), A, inputs.mask, inputs.is_weights, config)
        return -phi * A * logp, none, none
    if config.loss_type in ("dppo_tv", "dppo_kl"):
        old_logp = logp.detach() if inputs.old_logp is None else inputs.old_logp.to(logp.dtype)
        inside = dppo_trust_region(logp.detach(), old_logp, A, config)
        weight = ratio.detach().clamp(max=config.dppo_ratio_cap) * inside.to(logp.dtype)
        return -weight * A * logp, ~inside & (A <= 0), ~inside & (A > 0)
    if config.loss_type == "gmpo":
        geometric_ratio, low, high = gmpo_ratio(token_log_ratio, A, inputs.mask, config)
        return -gmpo_weight(inputs.is_weights, inputs.mask, A) * geometric_ratio * A, low, high
    clipped = ratio.clamp(1.0 - config.eps_low, 1.0 + config.eps_high)
    unclipped = ratio if config.delta_clip is None else ratio.clamp(max=config.delta_clip)
    pg = -torch.minimum(unclipped * A, clipped * A)
    if config.dual_clip_c is not None:
        pg = torch.where(A < 0, torch.minimum(pg, -A * config.dual_clip_c), pg)
    return pg, (unclipped < 1.0 - config.eps_low) & (A < 0), (unclipped > 1.0 + config.eps_high) & (A > 0)


def _by_sign(condition: torch.Tensor, if_true: float, if_false: float, like: torch.Tensor) -> torch.Tensor:
    """`if_true` where `condition`, else `if_false`, exactly in `like`'s dtype."""
    return torch.where(condition, like.new_tensor(if_true), like.new_tensor(if_false))


#: verl's guard in DPPO's binary KL: log((1 - p_old + 1e-8) / (1 - p + 1e-8)) stays finite at p = 1.
DPPO_KL_EPS = 1e-8


def dppo_trust_region(logp, old_logp, A, config: LossConfig) -> torch.Tensor:
    """DPPO's trust region (verl's ``compute_policy_loss_dppo_tv/kl``): True where the token's PG term
    is kept. With p = exp(logp), p_old = exp(old_logp), by the sign of A (A > 0, else A <= 0):
    dppo_tv keeps p - p_old <= eps_high (A > 0) or p - p_old >= -eps_low; dppo_kl keeps a binary KL
    D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8)) <= eps_high with
    p <= p_old allowed (A > 0), or D <= eps_low with p >= p_old allowed. [B, L] bool, no gradient.
    """
    p, p_old = logp.exp(), old_logp.exp()
    if config.loss_type == "dppo_tv":
        up, down = (p - p_old) <= config.eps_high, (p - p_old) >= -config.eps_low
    else:
        divergence = p_old * (old_logp - logp) + (1.0 - p_old) * torch.log(
            (1.0 - p_old + DPPO_KL_EPS) / (1.0 - p + DPPO_KL_EPS)
        )
        up = (divergence <= config.eps_high) | (p <= p_old)
        down = (divergence <= config.eps_low) | (p >= p_old)
    return torch.where(A > 0, up, down)


#: VESPO's floor on the sequence weight w, in log space: log(1e-8) (TRL's), and its ceiling.
VESPO_LOG_W_MIN = math.log(1e-8)
VESPO_LOG_W_MAX = 20.0


def vespo_weight(token_log_ratio, A, mask, is_weights, config: LossConfig) -> torch.Tensor:
    """phi = exp(lambda + k log w - lambda w) per token (constant along a row when A is [B]), no gradient.

    token_log_ratio, mask, is_weights: [B, L]; A: [B, L] or [B, 1].

    log w = clamp(sum_t m clamp(log r_t, -20, 20) + sum_t m clamp(log is_weight_t, log 1e-8, 20),
    log 1e-8, 20); (k, lambda) by the sign of A (A >= 0: the _pos pair), lambda at least 1e-4.
    A non-finite phi becomes 0.
    """
    m = mask.to(token_log_ratio.dtype)
    log_w = ordered_sum(token_log_ratio.clamp(-VESPO_LOG_W_MAX, VESPO_LOG_W_MAX) * m, -1, keepdim=True)
    if is_weights is not None:
        log_is = torch.where(mask, is_weights.to(m.dtype), 1.0).log().clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
        log_w = log_w + ordered_sum(log_is * m, -1, keepdim=True)
    log_w = log_w.clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
    nonnegative = A >= 0
    k = _by_sign(nonnegative, config.vespo_k_pos, config.vespo_k_neg, m)
    lam = _by_sign(nonnegative, config.vespo_lambda_pos, config.vespo_lambda_neg, m).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp())
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def gmpo_ratio(token_log_ratio, A, mask, config: LossConfig):
    """GMPO's ratio R_b = exp( sum_t m_t c_t / max(sum_t m_t, 1) ), differentiable, and its (low, high)
    clip indicators. token_log_ratio, mask: [B, L]; A: [B, L]. Returns R [B, 1] and two [B, L] bools.

    c_t = s min(s l_t, s clamp(l_t, -eps_low, eps_high)) with l_t = logp_t - old_logp_t and s = sign(A_t):
    the token's log-ratio clipped in log space on the side that the advantage's sign makes greedy (A > 0:
    l capped at eps_high; A < 0: l floored at -eps_low; A = 0: c = 0). This is the official code
    (github.com/callsys/GMPO, train_zero_math_gmpo.py, ``critic_type_modify == "gmpo"``, whose sign
    convention clips A = 0 as if A > 0, where the PG term is 0 anyway; verl's ``geo_mean`` loss, which
    GMPO's README points to, uses sign(A) as here). A clipped token adds a constant to the row's sum, so
    dR_b/dlogp_t = R_b m_t 1[t not clipped] / count_b (ties split by autograd add up to 1 inside the range).
    GMPO divides by count_b + 1e-8; max(count_b, 1) differs from it by 1e-8 relative and keeps an
    empty row at R = 1.
    """
    m = mask.to(token_log_ratio.dtype)
    s = torch.sign(A)
    bounded = token_log_ratio.clamp(-config.eps_low, config.eps_high)
    clipped_log_ratio = s * torch.minimum(s * token_log_ratio, s * bounded)
    count = ordered_sum(m, -1, keepdim=True).clamp(min=1.0)
    geometric_ratio = torch.exp(ordered_sum(clipped_log_ratio * m, -1, keepdim=True) / count)
    low = (token_log_ratio.detach() < -config.eps_low) & (A < 0)
    high = (token_log_ratio.detach() > config.eps_high) & (A > 0)
    return geometric_ratio, low, high


def gmpo_weight(is_weights, mask, like: torch.Tensor) -> torch.Tensor:
    """GMPO's rollout-correction weight per row, no gradient: the geometric mean over the row's unmasked
    tokens of `is_weights` (verl's ``geo_mean`` loss), W_b = exp( sum_t m_t log w_t / max(sum_t m_t, 1) ),
    [B, 1]; 1 without weights. A weight of 0 makes W_b = 0 (verl adds 1e-10 to w first)."""
    if is_weights is None:
        return torch.ones_like(like[:, :1])
    m = mask.to(like.dtype)
    log_w = torch.where(mask, is_weights.to(like.dtype), 1.0).log()
    count = ordered_sum(m, -1, keepdim=True).clamp(min=1.0)
    return torch.exp(ordered_sum(torch.where(mask, log_w, 0.0), -1, keepdim=True) / count)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, rho: float, active: torch.Tensor) -> torch.Tensor:
    """Positions of `active` whose entropy is at or above the (1 - rho) quantile of the unmasked entropies."""
    values = entropy.detach()[mask]
    if values.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(values.to(torch.float64), 1.0 - rho).to(entropy.dtype)
    return (entropy.detach() >= threshold) & active


def loss_normaliser(m: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """The divisor of Σ m·l for the token-sum loss types (`LossType.normaliser`)."""
    B, L = m.shape
    normaliser = LOSS_TYPES[config.loss_type].normaliser
    if normaliser == "call_tokens":
        return ordered_sum(m).clamp(min=1.0)
    # torch.full, not torch.tensor: a fill kernel, not a host-to-device copy (no sync on the hot path)
    if normaliser == "max_length":
        return torch.full((), float(B * (config.max_completion_length or L)), dtype=m.dtype, device=m.device)
    n = config.num_items_in_batch
    if n is None:
        return ordered_sum(m).clamp(min=1.0)
    if isinstance(n, torch.Tensor):
        return n.to(device=m.device, dtype=m.dtype).reshape(())
    return torch.full((), float(n), dtype=m.dtype, device=m.device)


def aggregate(per_token_loss: torch.Tensor, m: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """Reduce [B, L] per-token losses to the scalar loss of `config.loss_type`."""
    B, L = m.shape
    masked = per_token_loss * m
    aggregation = LOSS_TYPES[config.loss_type].aggregation
    if aggregation == "sequence_mean":
        row_means = ordered_sum(masked, -1) / ordered_sum(m, -1).clamp(min=1.0)
        return ordered_sum(row_means) / B
    if aggregation == "sequence_sum":
        if config.luspo_include_padding:
            # every position of row b counts, weighted by the row's token count n_b: Σ_bt l n_b / (B L)
            return ordered_sum(per_token_loss * ordered_sum(m, -1, keepdim=True)) / (B * L)
        return ordered_sum(ordered_sum(masked, -1)) / B
    return ordered_sum(masked) / loss_normaliser(m, config)


def reference_sage_loss(inputs: SageInputs, config: LossConfig) -> SageLossOutput:
    """The SAGE loss with materialised logits; autograd gives the gradients."""
    layout = layout_of(inputs)
    dtype = inputs.compute_dtype
    logp, entropy = reference_logprobs_and_entropy(
        inputs.hidden,
        inputs.weight,
        layout.to_rows(inputs.token_ids),
        bias=inputs.bias,
        temperature=config.temperature,
        logit_scale=config.logit_scale,
        logit_softcap=config.logit_softcap,
        dtype=dtype,
    )
    logp, entropy = layout.to_grid(logp), layout.to_grid(entropy)
    loss, per_token = token_stage(logp, entropy, inputs, config)
    active = inputs.loss_mask
    return SageLossOutput(
        loss=loss,
        logp=torch.where(active, logp.detach(), 0.0),
        entropy=torch.where(active, entropy.detach(), 0.0),
        q=per_token["q"],
        kl=per_token["kl"],
        ratio=per_token["ratio"],
        metrics=per_token["metrics"],
    )


# The backend interface (`backends.Backend`), as cpu.py and triton/ expose it.
sage_loss = reference_sage_loss
DTYPES = REFERENCE_DTYPES


def logprobs_and_entropy(hidden2d, weight, token_ids_flat, bias, temperature, logit_scale=1.0, logit_softcap=None):
    """`reference_logprobs_and_entropy` in float64 for float64 inputs, else accumulated in float32."""
    dtype = torch.float64 if hidden2d.dtype == torch.float64 else torch.float32
    return reference_logprobs_and_entropy(
        hidden2d,
        weight,
        token_ids_flat,
        bias=bias,
        temperature=temperature,
        logit_scale=logit_scale,
        logit_softcap=logit_softcap,
        dtype=dtype,
    )


def shard_stats(hidden2d, weight, bias, token_ids, temperature: float):
    """(lse, logp, entropy) [n] over one vocabulary shard (`backends.Backend`) by autograd through
    the materialised logits: float64 on float64 inputs, float32 otherwise."""
    dtype = torch.float64 if hidden2d.dtype == torch.float64 else torch.float32
    logp, entropy = reference_logprobs_and_entropy(
        hidden2d, weight, token_ids, bias=bias, temperature=temperature, dtype=dtype
    )
    return torch.logsumexp(logits_of(hidden2d, weight, bias, temperature, dtype), -1), logp, entropy
