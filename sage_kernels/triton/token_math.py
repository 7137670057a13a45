"""The per-token maths of the Triton token stage as device functions: the guide, the KL estimate
and its slope, and each loss type's policy-gradient term and slopes (docs/loss.md), with the
`spec` codes they switch on as kernel constants."""

from __future__ import annotations

import triton
import triton.language as tl

from ..loss_types import LOSS_TYPE_CODES
from ..reference import DPPO_KL_EPS, VESPO_LOG_W_MAX, VESPO_LOG_W_MIN
from ..spec import KL_CODES

# The codes of `spec` as kernel constants (k3 is the kernel's default branch).
KL_K1 = tl.constexpr(KL_CODES["k1"])
KL_K2 = tl.constexpr(KL_CODES["k2"])
KL_FK3 = tl.constexpr(KL_CODES["fk3"])
KL_K1_ST = tl.constexpr(KL_CODES["k1+"])
KL_K3_ST = tl.constexpr(KL_CODES["k3+"])
LOSS_CISPO = tl.constexpr(LOSS_TYPE_CODES["cispo"])
LOSS_SAPO = tl.constexpr(LOSS_TYPE_CODES["sapo"])
LOSS_VESPO = tl.constexpr(LOSS_TYPE_CODES["vespo"])
LOSS_LUSPO = tl.constexpr(LOSS_TYPE_CODES["luspo"])
LOSS_GMPO = tl.constexpr(LOSS_TYPE_CODES["gmpo"])
LOSS_DPPO_TV = tl.constexpr(LOSS_TYPE_CODES["dppo_tv"])
LOSS_DPPO_KL = tl.constexpr(LOSS_TYPE_CODES["dppo_kl"])
DPPO_EPS = tl.constexpr(DPPO_KL_EPS)
LOG_W_MIN = tl.constexpr(VESPO_LOG_W_MIN)
LOG_W_MAX = tl.constexpr(VESPO_LOG_W_MAX)


@triton.jit
def log_guide(log_q_ptr, at, m, ent, gamma, tau, q_min, q_max, HAS_LOG_Q: tl.constexpr, BRANCH: tl.constexpr):
    """log q per token: the caller's log_q, the branch guide from the entropy, or 0."""
    if HAS_LOG_Q:
        log_q = tl.load(log_q_ptr + at, mask=m, other=0.0)
    elif BRANCH:
        guide = 1.0 + gamma * tl.maximum(ent - tau, 0.0)
        log_q = tl.log(tl.minimum(tl.maximum(guide, q_min), q_max))
    else:
        log_q = tl.zeros_like(ent)
    return log_q


@triton.jit
def kl_and_slope(delta, KL: tl.constexpr):
    """The KL estimate from delta = log anchor - logp, and its derivative with respect to logp (the
    straight-through k1+ and k3+: k1's or k3's value, k2's slope -delta)."""
    if KL == KL_K1:
        kl = -delta
        slope = tl.full(delta.shape, 1.0, tl.float32)
    elif KL == KL_K1_ST:
        kl = -delta
        slope = -delta
    elif KL == KL_K2:
        kl = 0.5 * delta * delta
        slope = -delta
    elif KL == KL_FK3:
        # fk3 = r*d - (r - 1), r = exp(d): the same cancellation for small d; series sum_m (m-1) d^m / m!.
        r = tl.exp(delta)
        series = delta * (1.0 / 30.0 + delta * (1.0 / 144.0))
        series = delta * delta * (0.5 + delta * (1.0 / 3.0 + delta * (1.0 / 8.0 + series)))
        kl = tl.where(tl.abs(delta) < 0.1, series, r * delta - (r - 1.0))
        slope = -r * delta
    elif KL == KL_K3_ST:
        series = delta * delta * (0.5 + delta * (1.0 / 6.0 + delta * (1.0 / 24.0 + delta * (1.0 / 120.0))))
        kl = tl.where(tl.abs(delta) < 0.1, series, tl.exp(delta) - 1.0 - delta)
        slope = -delta
    else:
        # exp(d) - 1 - d cancels for small d in fp32: use its Taylor series there (error < 1e-9 relative).
        series = delta * delta * (0.5 + delta * (1.0 / 6.0 + delta * (1.0 / 24.0 + delta * (1.0 / 120.0))))
        em1 = tl.exp(delta) - 1.0
        kl = tl.where(tl.abs(delta) < 0.1, series, em1 - delta)
        slope = -em1
    return kl, slope


@triton.jit
def kl_with_slopes(
    ref_ptr,
    at,
    active,
    lp,
    log_q,
    ratio,
    beta,
    kl_clamp,
    KL: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_KL_CLAMP: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
):
    """The token stage's KL term per token: (its value, beta x its slope in logp at a fixed ratio,
    beta x its slope in the ratio); zeros without ref_logp."""
    kl = tl.zeros_like(lp)
    kl_slope = tl.zeros_like(lp)
    kl_ratio_slope = tl.zeros_like(lp)
    if HAS_REF:
        ref = tl.load(ref_ptr + at, mask=active, other=0.0)
        delta = ref + log_q - lp
        if HAS_KL_CLAMP:  # the opt-in overflow guard, torch.clamp's gradient: zero outside the bounds
            inside = (delta >= -kl_clamp) & (delta <= kl_clamp)
            delta = tl.minimum(tl.maximum(delta, -kl_clamp), kl_clamp)
        kl, kl_slope = kl_and_slope(delta, KL)
        if HAS_KL_CLAMP:
            kl_slope = tl.where(inside, kl_slope, 0.0)
        kl = tl.where(active, kl, 0.0)
        if BIAS_CORRECTION:
            kl_ratio_slope = tl.where(beta != 0.0, beta * kl, 0.0)
            kl = kl * ratio
            kl_slope = kl_slope * ratio
        kl_slope = tl.where(active & (beta != 0.0), beta * kl_slope, 0.0)
    return kl, kl_slope, kl_ratio_slope


@triton.jit
def tie_weight(a, b):
    """d min(a, b) / d a as autograd computes it: 1 if a < b, 1/2 on a tie, 0 otherwise."""
    return tl.where(a < b, 1.0, tl.where(a == b, 0.5, 0.0))


@triton.jit
def clipped_pg(ratio, adv, eps_low, eps_high, delta_clip, dual_clip_c, HAS_DELTA: tl.constexpr, HAS_DUAL: tl.constexpr):
    """(pg, dpg/dratio, low, high) of PPO's clipped term (low/high: the clip indicators)."""
    low = 1.0 - eps_low
    high = 1.0 + eps_high
    if HAS_DELTA:
        unclipped = tl.minimum(ratio, delta_clip)
        d_unclipped = (ratio <= delta_clip).to(tl.float32)
    else:
        unclipped = ratio
        d_unclipped = tl.full(ratio.shape, 1.0, tl.float32)
    clipped = tl.minimum(tl.maximum(ratio, low), high)
    d_clipped = ((ratio >= low) & (ratio <= high)).to(tl.float32)
    u_adv = unclipped * adv
    c_adv = clipped * adv
    w_unclipped = tie_weight(u_adv, c_adv)
    pg = -tl.minimum(u_adv, c_adv)
    d_pg = -adv * (w_unclipped * d_unclipped + (1.0 - w_unclipped) * d_clipped)
    if HAS_DUAL:
        bound = -adv * dual_clip_c
        negative = adv < 0
        d_pg = tl.where(negative, d_pg * tie_weight(pg, bound), d_pg)
        pg = tl.where(negative, tl.minimum(pg, bound), pg)
    return pg, d_pg, (unclipped < low) & (adv < 0), (unclipped > high) & (adv > 0)


@triton.jit
def gmpo_clip(log_ratio, adv, eps_low, eps_high):
    """GMPO's token clip in log space (`reference.gmpo_ratio`): (c, passes, low, high) with c the clipped
    log-ratio, passes = dc/dlog_ratio as autograd gives it (1, or 0 where the clip binds or A = 0),
    low/high the clip indicators (log r < -eps_low with A < 0, log r > eps_high with A > 0)."""
    positive = adv > 0
    negative = adv < 0
    c = tl.where(positive, tl.minimum(log_ratio, eps_high), tl.where(negative, tl.maximum(log_ratio, -eps_low), 0.0))
    passes = tl.where((positive & (log_ratio <= eps_high)) | (negative & (log_ratio >= -eps_low)), 1.0, 0.0)
    return c, passes, negative & (log_ratio < -eps_low), positive & (log_ratio > eps_high)


@triton.jit
def dppo_inside(lp, log_ratio, adv, eps_low, eps_high, LOSS: tl.constexpr):
    """DPPO's trust region (`reference.dppo_trust_region`) as 1.0 (kept) or 0.0, from logp and the
    log-ratio logp - old_logp."""
    p = tl.exp(lp)
    p_old = tl.exp(lp - log_ratio)
    if LOSS == LOSS_DPPO_TV:
        up = (p - p_old) <= eps_high
        down = (p - p_old) >= -eps_low
    else:
        divergence = -p_old * log_ratio + (1.0 - p_old) * tl.log((1.0 - p_old + DPPO_EPS) / (1.0 - p + DPPO_EPS))
        up = (divergence <= eps_high) | (p <= p_old)
        down = (divergence <= eps_low) | (p >= p_old)
    return tl.where(adv > 0, up, down).to(tl.float32)


@triton.jit
def policy_gradient(
    ratio,
    log_ratio,
    lp,
    adv,
    log_w,
    gmpo_ratio,
    gmpo_weight,
    eps_low,
    eps_high,
    delta_clip,
    dual_clip_c,
    sapo_t_pos,
    sapo_t_neg,
    vespo_k_pos,
    vespo_lambda_pos,
    vespo_k_neg,
    vespo_lambda_neg,
    dppo_ratio_cap,
    LOSS: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_DUAL: tl.constexpr,
):
    """(pg, dpg/dratio, dpg/dlogp at a fixed ratio, low, high) of the loss type's PG term; for gmpo
    the ratio is the row's `gmpo_ratio` (dpg/dratio is its slope) times the row weight `gmpo_weight`."""
    d_pg_logp = tl.zeros(ratio.shape, dtype=tl.float32)
    low = d_pg_logp != 0.0
    high = low
    if LOSS == LOSS_CISPO:
        weight = tl.minimum(ratio, eps_high)  # detached: no slope in the ratio
        pg = -weight * adv * lp
        d_pg = tl.zeros(ratio.shape, dtype=tl.float32)
        d_pg_logp = -weight * adv
        high = (ratio > eps_high) & (adv > 0)
    elif LOSS == LOSS_SAPO:
        temperature = tl.where(adv > 0, sapo_t_pos, sapo_t_neg)
        gate = tl.sigmoid(temperature * (ratio - 1.0))
        pg = -gate * (4.0 / temperature) * adv
        d_pg = -4.0 * adv * gate * (1.0 - gate)
    elif LOSS == LOSS_VESPO:
        nonnegative = adv >= 0
        k = tl.where(nonnegative, vespo_k_pos, vespo_k_neg)
        lam = tl.maximum(tl.where(nonnegative, vespo_lambda_pos, vespo_lambda_neg), 1e-4)
        phi = tl.exp(lam + k * log_w - lam * tl.exp(log_w))
        phi = tl.where((phi == phi) & (tl.abs(phi) < float("inf")), phi, 0.0)  # TRL's nan_to_num(0)
        pg = -phi * adv * lp
        d_pg = tl.zeros(ratio.shape, dtype=tl.float32)
        d_pg_logp = -phi * adv
    elif LOSS == LOSS_DPPO_TV or LOSS == LOSS_DPPO_KL:
        inside = dppo_inside(lp, log_ratio, adv, eps_low, eps_high, LOSS)
        weight = tl.minimum(ratio, dppo_ratio_cap) * inside  # detached: no slope in the ratio
        pg = -weight * adv * lp
        d_pg = tl.zeros(ratio.shape, dtype=tl.float32)
        d_pg_logp = -weight * adv
        low = (inside == 0.0) & (adv <= 0)
        high = (inside == 0.0) & (adv > 0)
    elif LOSS == LOSS_GMPO:
        d_pg = -adv * gmpo_weight
        pg = d_pg * gmpo_ratio
        _, _, low, high = gmpo_clip(log_ratio, adv, eps_low, eps_high)
    else:
        pg, d_pg, low, high = clipped_pg(ratio, adv, eps_low, eps_high, delta_clip, dual_clip_c, HAS_DELTA, HAS_DUAL)
    return pg, d_pg, d_pg_logp, low, high
