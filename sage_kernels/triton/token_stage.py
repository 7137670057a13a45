"""The per-token stage in Triton: guide, anchor, KL, ratio, PG term, loss and its slopes.

One program per sequence (row b) walks its L positions in BLOCK_L chunks:

1. row statistics: the token count and, for sequence-level ratios, sum_t m (logp - old_logp);
   for vespo, the log of the sequence weight w (docs/loss.md); for the off-policy mask,
   sum_t m (sampling_logp - logp) (old_logp without sampling log-probs); for gmpo, sum_t m c_t (the
   token log-ratios clipped in log space by the sign of A) and sum_t m log w_t (the rollout weights'
   geometric mean), which give the row's ratio R_b and weight W_b;
2. every per-token quantity of docs/loss.md, written for all positions (positions outside the
   loss get q = ratio = 1, kl = 0, g = c = 0), the row's share of the loss and of each metric;
3. sequence-level ratios only: the ratio is shared by the row, so g_t needs the row sum
   G_b = sum_s scale_s dl_s/dr from step 2: g_t += G_b r m_t / count_b; for gmpo the same with
   R_b, skipping the tokens whose clip binds: g_t += G_b R_b m_t 1[t not clipped] / count_b.

g = dloss/dlogp and c = dloss/dH already include the loss-type normaliser
(scale_t = m_t / (B max(count_b, 1)) for grpo and sapo, m_t / B for luspo, m_t / normaliser
otherwise). Under luspo_include_padding (PADDED) every position enters the loss with
scale_t = count_b / (B L), while the mask still drives the row statistics, the quantile and the
metrics. The batch-wide inputs (the token-sum normaliser and the top-entropy threshold)
are 0-d device tensors computed beforehand by `batch_statistics`, so nothing syncs.

Gradient conventions follow PyTorch autograd of the reference exactly: clamp passes the
gradient on the closed interval, and `minimum` splits it in half on ties (which is what
happens inside the clip range, where the clipped and unclipped products coincide).
Per-row partial sums (loss, metric sums, q min/max) are reduced over rows afterwards in a
fixed order, so the result is deterministic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from ..loss_types import LOSS_TYPES
from ..metrics import COLUMNS, ROW_STATS
from ..reference import loss_normaliser
from ..spec import LossConfig
from .tiles import interpreting, new_buffer
from .token_math import (
    LOG_W_MAX,
    LOG_W_MIN,
    LOSS_GMPO,
    LOSS_LUSPO,
    LOSS_VESPO,
    gmpo_clip,
    kl_with_slopes,
    log_guide,
    policy_gradient,
)
from .token_options import kernel_options

if TYPE_CHECKING:
    from .boundary import LossTensors


@triton.heuristics(
    {
        "HAS_OLD": lambda args: args["old_ptr"] is not None,
        "HAS_REF": lambda args: args["ref_ptr"] is not None,
        "HAS_IS_WEIGHTS": lambda args: args["isw_ptr"] is not None,
        "HAS_LOG_Q": lambda args: args["log_q_ptr"] is not None,
        "HAS_SAMPLING": lambda args: args["sampling_ptr"] is not None,
        "HAS_QUANTILE": lambda args: args["threshold_ptr"] is not None,
    }
)
@triton.jit(do_not_specialize=["B", "L"])  # see tiles.py
def _token_stage_kernel(
    logp_ptr,
    entropy_ptr,
    mask_ptr,
    adv_ptr,
    old_ptr,
    ref_ptr,
    isw_ptr,
    log_q_ptr,
    sampling_ptr,
    threshold_ptr,
    inv_norm_ptr,
    q_ptr,
    kl_ptr,
    ratio_ptr,
    g_ptr,
    c_ptr,
    row_stats_ptr,
    B,
    L,
    beta,  # beta to OFF_POLICY: token_options.TOKEN_STAGE_OPTIONS, in its order
    gamma,
    tau,
    q_min,
    q_max,
    eps_low,
    eps_high,
    delta_clip,
    dual_clip_c,
    entropy_coef,
    sapo_t_pos,
    sapo_t_neg,
    vespo_k_pos,
    vespo_lambda_pos,
    vespo_k_neg,
    vespo_lambda_neg,
    kl_clamp,
    off_policy_threshold,
    dppo_ratio_cap,
    KL: tl.constexpr,
    BRANCH: tl.constexpr,
    SEQUENCE: tl.constexpr,
    LOSS: tl.constexpr,
    PADDED: tl.constexpr,
    PER_SEQUENCE_MEAN: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_DUAL: tl.constexpr,
    HAS_KL_CLAMP: tl.constexpr,
    OFF_POLICY: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_IS_WEIGHTS: tl.constexpr,
    HAS_LOG_Q: tl.constexpr,
    HAS_SAMPLING: tl.constexpr,
    HAS_QUANTILE: tl.constexpr,
    COLUMNS: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * L
    offs = tl.arange(0, BLOCK_L)

    # 1. row statistics
    count = tl.zeros([BLOCK_L], dtype=tl.float32)
    log_ratio_sum = tl.zeros([BLOCK_L], dtype=tl.float32)
    log_w_sum = tl.zeros([BLOCK_L], dtype=tl.float32)
    behaviour_kl_sum = tl.zeros([BLOCK_L], dtype=tl.float32)
    gmpo_sum = tl.zeros([BLOCK_L], dtype=tl.float32)
    gmpo_log_w_sum = tl.zeros([BLOCK_L], dtype=tl.float32)
    for l0 in range(0, L, BLOCK_L):
        in_row = l0 + offs < L
        m = tl.load(mask_ptr + base + l0 + offs, mask=in_row, other=0) != 0
        count += m.to(tl.float32)
        if HAS_OLD and (SEQUENCE or LOSS == LOSS_VESPO):
            lp = tl.load(logp_ptr + base + l0 + offs, mask=in_row, other=0.0)
            old = tl.load(old_ptr + base + l0 + offs, mask=in_row, other=0.0)
            log_ratio_sum += tl.where(m, lp - old, 0.0)
            log_w_sum += tl.where(m, tl.minimum(tl.maximum(lp - old, -LOG_W_MAX), LOG_W_MAX), 0.0)
        if HAS_IS_WEIGHTS and LOSS == LOSS_VESPO:
            log_is = tl.log(tl.load(isw_ptr + base + l0 + offs, mask=m, other=1.0))
            log_w_sum += tl.where(m, tl.minimum(tl.maximum(log_is, LOG_W_MIN), LOG_W_MAX), 0.0)
        if OFF_POLICY and (HAS_SAMPLING or HAS_OLD):  # without either the behaviour policy is logp: 0
            lp = tl.load(logp_ptr + base + l0 + offs, mask=in_row, other=0.0)
            if HAS_SAMPLING:  # NaN: a token the sampler could not score adds nothing
                behaviour = tl.load(sampling_ptr + base + l0 + offs, mask=m, other=0.0)
                behaviour_kl = tl.where(behaviour != behaviour, 0.0, behaviour - lp)
            else:
                behaviour_kl = tl.load(old_ptr + base + l0 + offs, mask=m, other=0.0) - lp
            behaviour_kl_sum += tl.where(m, behaviour_kl, 0.0)
        if LOSS == LOSS_GMPO:
            token_log_ratio = tl.zeros([BLOCK_L], dtype=tl.float32)
            if HAS_OLD:
                lp = tl.load(logp_ptr + base + l0 + offs, mask=in_row, other=0.0)
                token_log_ratio = lp - tl.load(old_ptr + base + l0 + offs, mask=m, other=0.0)
            adv = tl.load(adv_ptr + base + l0 + offs, mask=m, other=0.0)
            clipped_log_ratio, _, _, _ = gmpo_clip(token_log_ratio, adv, eps_low, eps_high)
            gmpo_sum += tl.where(m, clipped_log_ratio, 0.0)
            if HAS_IS_WEIGHTS:
                gmpo_log_w_sum += tl.where(m, tl.log(tl.load(isw_ptr + base + l0 + offs, mask=m, other=1.0)), 0.0)
    n_tokens = tl.sum(count, axis=0)
    per_token_share = 1.0 / tl.maximum(n_tokens, 1.0)
    if PER_SEQUENCE_MEAN:
        scale = per_token_share / B
    elif PADDED:  # luspo with padding: every position of the row, weighted by its token count
        scale = n_tokens / B / L
    elif LOSS == LOSS_LUSPO:
        scale = 1.0 / B
    else:
        scale = tl.load(inv_norm_ptr)
    seq_ratio = tl.exp(tl.sum(log_ratio_sum, axis=0) * per_token_share)
    log_w = tl.minimum(tl.maximum(tl.sum(log_w_sum, axis=0), LOG_W_MIN), LOG_W_MAX)
    gmpo_ratio = tl.exp(tl.sum(gmpo_sum, axis=0) * per_token_share)
    gmpo_weight = tl.exp(tl.sum(gmpo_log_w_sum, axis=0) * per_token_share)
    if HAS_QUANTILE:
        threshold = tl.load(threshold_ptr)
    # the off-policy mask keeps the row's A >= 0 tokens, and all of them when it is near the sampler
    near_behaviour = tl.where(tl.sum(behaviour_kl_sum, axis=0) * per_token_share <= off_policy_threshold, 1.0, 0.0)

    # 2. per-token values, the row's loss and metric sums
    loss_sum = tl.zeros([BLOCK_L], dtype=tl.float32)
    kl_sum = tl.zeros([BLOCK_L], dtype=tl.float32)
    entropy_sum = tl.zeros([BLOCK_L], dtype=tl.float32)
    q_sum = tl.zeros([BLOCK_L], dtype=tl.float32)
    q_lo = tl.full([BLOCK_L], float("inf"), tl.float32)
    q_hi = tl.full([BLOCK_L], float("-inf"), tl.float32)
    low_sum = tl.zeros([BLOCK_L], dtype=tl.float32)
    high_sum = tl.zeros([BLOCK_L], dtype=tl.float32)
    region_sum = tl.zeros([BLOCK_L], dtype=tl.float32)
    ratio_slope_sum = tl.zeros([BLOCK_L], dtype=tl.float32)
    for l0 in range(0, L, BLOCK_L):
        at = base + l0 + offs
        in_row = l0 + offs < L
        m = tl.load(mask_ptr + at, mask=in_row, other=0) != 0
        # the positions that enter the loss (m: those the metrics and row statistics count)
        if PADDED:
            active = in_row
        else:
            active = m
        lp = tl.where(active, tl.load(logp_ptr + at, mask=in_row, other=0.0), 0.0)
        ent = tl.where(active, tl.load(entropy_ptr + at, mask=in_row, other=0.0), 0.0)
        adv = tl.load(adv_ptr + at, mask=active, other=0.0)

        log_q = log_guide(log_q_ptr, at, active, ent, gamma, tau, q_min, q_max, HAS_LOG_Q, BRANCH)
        log_q = tl.where(active, log_q, 0.0)
        q = tl.exp(log_q)

        log_ratio = tl.zeros([BLOCK_L], dtype=tl.float32)
        if HAS_OLD:
            log_ratio = lp - tl.load(old_ptr + at, mask=active, other=0.0)
        if SEQUENCE:
            ratio = tl.zeros([BLOCK_L], dtype=tl.float32) + seq_ratio
        elif HAS_OLD:
            ratio = tl.exp(log_ratio)
        else:
            ratio = tl.full([BLOCK_L], 1.0, tl.float32)

        kl, kl_slope, kl_ratio_slope = kl_with_slopes(
            ref_ptr, at, active, lp, log_q, ratio, beta, kl_clamp, KL, HAS_REF, HAS_KL_CLAMP, BIAS_CORRECTION
        )

        pg, d_pg, d_pg_logp, low, high = policy_gradient(
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
            LOSS,
            HAS_DELTA,
            HAS_DUAL,
        )
        if HAS_QUANTILE:
            keep = (ent >= threshold).to(tl.float32)
            pg *= keep
            d_pg *= keep
            d_pg_logp *= keep
        if OFF_POLICY:
            kept = tl.maximum(tl.where(adv >= 0.0, 1.0, 0.0), near_behaviour)
            pg *= kept
            d_pg *= kept
            d_pg_logp *= kept
        if HAS_IS_WEIGHTS and (LOSS != LOSS_VESPO and LOSS != LOSS_GMPO):  # both fold w into a row weight
            weights = tl.load(isw_ptr + at, mask=active, other=1.0)
            pg *= weights
            d_pg *= weights
            d_pg_logp *= weights

        token_scale = tl.where(active, scale, 0.0)
        kl_term = tl.where(beta != 0.0, beta * kl, 0.0)
        loss_sum += tl.where(active, token_scale * (pg + kl_term - entropy_coef * ent), 0.0)
        kl_sum += tl.where(m, kl, 0.0)
        entropy_sum += tl.where(m, ent, 0.0)
        q_sum += tl.where(m, q, 0.0)
        q_lo = tl.minimum(q_lo, tl.where(m, q, float("inf")))
        q_hi = tl.maximum(q_hi, tl.where(m, q, float("-inf")))
        low = m & low
        high = m & high
        low_sum += low.to(tl.float32)
        high_sum += high.to(tl.float32)
        region_sum += (low | high).to(tl.float32)

        tl.store(q_ptr + at, tl.where(active, q, 1.0), mask=in_row)
        tl.store(kl_ptr + at, kl, mask=in_row)
        tl.store(ratio_ptr + at, tl.where(active, ratio, 1.0), mask=in_row)
        tl.store(c_ptr + at, -entropy_coef * token_scale, mask=in_row)
        local = token_scale * (d_pg_logp + kl_slope)
        if SEQUENCE:
            ratio_slope_sum += tl.where(active, token_scale * (d_pg + kl_ratio_slope), 0.0)
            tl.store(g_ptr + at, local, mask=in_row)
        elif LOSS == LOSS_GMPO:  # d_pg is the slope in the row's ratio: step 3
            ratio_slope_sum += tl.where(active, token_scale * d_pg, 0.0)
            tl.store(g_ptr + at, local + token_scale * kl_ratio_slope * ratio, mask=in_row)
        else:
            tl.store(g_ptr + at, local + token_scale * (d_pg + kl_ratio_slope) * ratio, mask=in_row)

    # 3. sequence-level ratios (and gmpo's): every token's logp moves the shared ratio
    if SEQUENCE or LOSS == LOSS_GMPO:
        tl.debug_barrier()  # step 2's stores of g are visible to every thread of the program
        if SEQUENCE:
            d_log_ratio = tl.sum(ratio_slope_sum, axis=0) * seq_ratio * per_token_share
        else:
            d_log_ratio = tl.sum(ratio_slope_sum, axis=0) * gmpo_ratio * per_token_share
        for l0 in range(0, L, BLOCK_L):
            at = base + l0 + offs
            in_row = l0 + offs < L
            m = tl.load(mask_ptr + at, mask=in_row, other=0) != 0
            local = tl.load(g_ptr + at, mask=in_row, other=0.0)
            if LOSS == LOSS_GMPO:  # a token whose clip binds adds a constant to the row's sum
                token_log_ratio = tl.zeros([BLOCK_L], dtype=tl.float32)
                if HAS_OLD:
                    lp = tl.load(logp_ptr + at, mask=in_row, other=0.0)
                    token_log_ratio = lp - tl.load(old_ptr + at, mask=m, other=0.0)
                adv = tl.load(adv_ptr + at, mask=m, other=0.0)
                _, passes, _, _ = gmpo_clip(token_log_ratio, adv, eps_low, eps_high)
                tl.store(g_ptr + at, local + tl.where(m, d_log_ratio * passes, 0.0), mask=in_row)
            else:
                tl.store(g_ptr + at, local + tl.where(m, d_log_ratio, 0.0), mask=in_row)

    stats = row_stats_ptr + row * len(COLUMNS)
    tl.store(stats + COLUMNS.loss, tl.sum(loss_sum, axis=0))
    tl.store(stats + COLUMNS.kl, tl.sum(kl_sum, axis=0))
    tl.store(stats + COLUMNS.entropy, tl.sum(entropy_sum, axis=0))
    tl.store(stats + COLUMNS.q, tl.sum(q_sum, axis=0))
    tl.store(stats + COLUMNS.q_min, tl.min(q_lo, axis=0))
    tl.store(stats + COLUMNS.q_max, tl.max(q_hi, axis=0))
    tl.store(stats + COLUMNS.low, tl.sum(low_sum, axis=0))
    tl.store(stats + COLUMNS.high, tl.sum(high_sum, axis=0))
    tl.store(stats + COLUMNS.region, tl.sum(region_sum, axis=0))


def entropy_threshold(entropy: torch.Tensor, mask: torch.Tensor, rho: float) -> torch.Tensor:
    """The (1 - rho) quantile of the unmasked entropies as a 0-d float32 device tensor.

    torch.quantile's linear interpolation, reproduced without a host sync: a sort of the
    O(N) entropies with masked ones pushed to +inf, then two gathers at device-side ranks.
    A selection in Triton would save the O(N log N) sort, which is negligible next to the
    O(N V D) sweep. With no unmasked token the threshold is +inf (no token kept).
    """
    ordered = torch.where(mask, entropy, float("inf")).reshape(-1).to(torch.float64).sort().values
    count = mask.sum().to(torch.float64)
    rank = (1.0 - rho) * (count - 1.0).clamp(min=0.0)
    below, above = rank.floor(), rank.ceil()
    v_below = ordered.gather(0, below.long().reshape(1))
    v_above = ordered.gather(0, above.long().reshape(1))
    return torch.lerp(v_below, v_above, rank - below).reshape(()).to(torch.float32)


def batch_statistics(entropy: torch.Tensor, mask: torch.Tensor, config: LossConfig):
    """(inverse normaliser, entropy threshold): the 0-d inputs of the token stage that need the
    whole batch; either is None when `config` does not use it."""
    inv_norm = None
    if LOSS_TYPES[config.loss_type].aggregation == "token_sum":
        inv_norm = (1.0 / loss_normaliser(mask.to(torch.float32), config)).to(torch.float32).reshape(())
    threshold = None
    if config.top_entropy_quantile < 1.0:
        threshold = entropy_threshold(entropy, mask, config.top_entropy_quantile)
    return inv_norm, threshold


class StageOutputs(NamedTuple):
    """The token stage's outputs: q, kl, ratio [B, L]; g = dloss/dlogp and c = dloss/dH flat [B*L];
    the per-row partial results [B, len(ROW_STATS)] (`metrics.COLUMNS` names the columns)."""

    q: torch.Tensor
    kl: torch.Tensor
    ratio: torch.Tensor
    g: torch.Tensor
    c: torch.Tensor
    row_stats: torch.Tensor


def token_stage(logp, entropy, tensors: LossTensors, config: LossConfig) -> StageOutputs:
    """Run the per-token stage on the [B, L] float32 `logp` and `entropy` of a call's `tensors`
    (their mask, advantages and optional per-token inputs, row-major)."""
    mask = tensors.mask
    B, L = mask.shape
    device = logp.device
    inv_norm, threshold = batch_statistics(entropy, mask, config)
    q, kl, ratio = (new_buffer((B, L), torch.float32, device) for _ in range(3))
    g, c = (new_buffer((B * L,), torch.float32, device) for _ in range(2))
    row_stats = new_buffer((B, len(ROW_STATS)), torch.float32, device)
    block_l = min(triton.next_power_of_2(L), 128 if interpreting() else 1024)
    _token_stage_kernel[(B,)](
        logp,
        entropy,
        mask.contiguous().view(torch.uint8),
        tensors.advantages,
        tensors.old_logp,
        tensors.ref_logp,
        tensors.is_weights,
        tensors.log_q,
        tensors.sampling_logp,
        threshold,
        inv_norm,
        q,
        kl,
        ratio,
        g,
        c,
        row_stats,
        B,
        L,
        **kernel_options(config),
        COLUMNS=COLUMNS,
        BLOCK_L=block_l,
        num_warps=4,
    )
    return StageOutputs(q, kl, ratio, g, c, row_stats)
