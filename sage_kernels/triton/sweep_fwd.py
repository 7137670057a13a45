"""Forward vocabulary sweep: log-sum-exp, the target log-prob and the entropy per token.

For each token the kernel walks the vocabulary in [BLOCK_N tokens x BLOCK_V vocab] tiles
of z = (h W^T + b) / T (scaled, and softcapped under SOFTCAP: `head_logits`), computed with
`tl.dot` into an fp32 accumulator over D in BLOCK_D chunks (tails masked, so any V and D work).
The logits never leave registers and are never rounded to the input dtype. Per token it keeps,
relative to the running max m:

    s = sum_v exp(z_v - m)                      (rescaled sum-exp)
    t = sum_v exp(z_v - m) (z_v - m)            (rescaled sum of p*z, shifted by m)

so lse = m + log s and H = lse - sum_v p_v z_v = log s - t / s with no cancellation
between large numbers when the logits are large and confident. When m grows to m',
s <- a s and t <- a (t - s (m' - m)) with a = exp(m - m').

Only valid tokens are computed: the launcher orders rows valid-first with a stable sort
of the mask (no host sync: the count stays on the device and programs past it exit), as
Cut Cross-Entropy compacts its valid rows. The vocabulary is split into ranges, each walked
by its own program: to fill the GPU when there are few token blocks, and so that the programs
running at once (the splits vary fastest in the launch order) share few token blocks, whose
hidden rows then stay in L2 across the vocabulary walk instead of being read again from memory
for every vocab tile. Each split writes its partial (m, s, t, target logit) and a small
O(N x splits) combine finishes the job.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..spec import LogitMap
from .gemm import on_device
from .tiles import dot_precision, dot_upcast, interpreting, new_buffer, tiles_for

#: running-max start value: finite, so the first rescale computes 0 * finite, never 0 * inf
#: (a constexpr: jitted code may read only constexpr globals).
NEG_START = tl.constexpr(-1.0e30)


@triton.jit
def head_logits(a, logit_inner, logit_outer, SOFTCAP: tl.constexpr):
    """Logits from the fp32 head output `a` (`spec.LogitMap`): inner * a, or outer * tanh(inner * a)
    under SOFTCAP, with tanh(x) = 2 sigmoid(2x) - 1 (a tanh that both the compiler and the
    interpreter have; it saturates to +-1, finite, for any |x|)."""
    if SOFTCAP:
        return logit_outer * (2.0 * tl.sigmoid(2.0 * logit_inner * a) - 1.0)
    return a * logit_inner


@triton.heuristics({"HAS_BIAS": lambda args: args["bias_ptr"] is not None})
@triton.jit(do_not_specialize=["N", "V", "tiles_per_split", "n_splits"])  # see tiles.py
def _sweep_fwd_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    ids_ptr,
    rows_ptr,
    count_ptr,
    max_ptr,
    sumexp_ptr,
    shifted_pz_ptr,
    target_ptr,
    N,
    V,
    D,
    stride_h,
    stride_w,
    logit_inner,
    logit_outer,
    tiles_per_split,
    n_splits,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one grid axis (limit 2^31 - 1), vocab splits varying fastest: a wave of programs covers few
    # token blocks, whose hidden rows stay in L2 while it walks the vocabulary, and reads each
    # split's weight tiles once for all of them
    pid = tl.program_id(0).to(tl.int64)
    split = pid % n_splits
    pid_n = pid // n_splits
    count = tl.load(count_ptr).to(tl.int64)
    start = pid_n * BLOCK_N
    if start < count:
        idx = start + tl.arange(0, BLOCK_N)
        valid = idx < count
        rows = tl.load(rows_ptr + idx, mask=valid, other=0)
        targets = tl.load(ids_ptr + rows, mask=valid, other=-1)
        run_max = tl.full([BLOCK_N], NEG_START, dtype=tl.float32)
        sumexp = tl.zeros([BLOCK_N], dtype=tl.float32)
        shifted_pz = tl.zeros([BLOCK_N], dtype=tl.float32)
        target = tl.zeros([BLOCK_N], dtype=tl.float32)
        v_begin = split * tiles_per_split * BLOCK_V
        v_end = tl.minimum(v_begin + tiles_per_split * BLOCK_V, V)
        for v0 in range(v_begin, v_end, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            col_ok = cols < V
            acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
            for k0 in range(0, D, BLOCK_D):
                ks = k0 + tl.arange(0, BLOCK_D)
                k_ok = ks < D
                h = tl.load(
                    hidden_ptr + rows[:, None] * stride_h + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
                )
                w = tl.load(
                    weight_ptr + cols[:, None] * stride_w + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0
                )
                if DOT_UPCAST:
                    h, w = h.to(tl.float32), w.to(tl.float32)
                acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            # columns past V at a finite -1e30: exp gives exactly 0 there and 0 * shifted stays 0,
            # so one select covers them (fewer live [BLOCK_N, BLOCK_V] values: no spills)
            z = tl.where(col_ok[None, :], head_logits(acc, logit_inner, logit_outer, SOFTCAP), NEG_START)
            new_max = tl.maximum(run_max, tl.max(z, axis=1))
            rescale = tl.exp(run_max - new_max)
            shifted = z - new_max[:, None]
            e = tl.exp(shifted)
            shifted_pz = rescale * (shifted_pz - sumexp * (new_max - run_max)) + tl.sum(e * shifted, axis=1)
            sumexp = rescale * sumexp + tl.sum(e, axis=1)
            run_max = new_max
            target += tl.sum(tl.where(cols[None, :] == targets[:, None], z, 0.0), axis=1)
        out = split * N + rows
        tl.store(max_ptr + out, run_max, mask=valid)
        tl.store(sumexp_ptr + out, sumexp, mask=valid)
        tl.store(shifted_pz_ptr + out, shifted_pz, mask=valid)
        tl.store(target_ptr + out, target, mask=valid)


def compact_rows(mask_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, count): all row indices with the valid ones first (in order), and their number
    as a 0-d int64 device tensor. A stable sort, so no host sync is needed for the count."""
    rows = torch.argsort((~mask_flat).to(torch.int8), stable=True)
    return rows, mask_flat.sum()


#: tests set it to False to run as under CUDA-graph capture, where the valid count stays on the device.
READ_VALID_COUNT = True


def host_row_count(count: torch.Tensor, n_rows: int) -> tuple[int, bool]:
    """(rows the launches and GEMMs cover, whether that is the exact valid count).

    The one host read of a loss call: the valid count sizes the grids and the GEMMs, so masked
    tokens (often 30-60% of an RL batch) cost nothing. It is read right after the mask is
    reduced, so on a GPU the host waits for the work already queued (the model's forward),
    not for any of the loss's kernels, and the device idles only for the next launch. Under
    CUDA-graph capture nothing may be read: every row is covered, and kernels skip those past
    the device-side count (masked rows then go through the GEMMs as zeros).
    """
    if not READ_VALID_COUNT or (count.is_cuda and torch.cuda.is_current_stream_capturing()):
        return n_rows, False
    return int(count), True


#: token blocks a wave of programs (about one per SM) should share at most: their hidden rows
#: (128 x D 3584 bf16 = 0.9 MB a block) stay in L2 while the wave walks the vocabulary.
L2_TOKEN_BLOCKS = 16


def _num_splits(n_rows: int, n_tiles: int, block_n: int, device: torch.device) -> int:
    """Vocab splits: about two programs per SM when token blocks alone are too few, and at least
    enough that a wave of programs covers at most `L2_TOKEN_BLOCKS` token blocks; at most one
    split per 8 vocab tiles."""
    if interpreting() or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    blocks = triton.cdiv(n_rows, block_n)
    fill = triton.cdiv(2 * sms, blocks)
    reuse = triton.cdiv(sms, L2_TOKEN_BLOCKS) if blocks > L2_TOKEN_BLOCKS else 1
    return max(1, min(max(fill, reuse), n_tiles // 8))


def sweep_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias,
    token_ids: torch.Tensor,
    rows: torch.Tensor,
    count: torch.Tensor,
    logits: LogitMap,
    rows_to_do: int | None = None,
):
    """lse, logp and entropy [N] in float32 for the valid rows (`rows[:count]`), of the logits `logits` maps.

    Entries of other rows are unspecified (the caller masks them). `hidden` [N, D] and
    `weight` [V, D] have unit stride along D; `token_ids` [N] int64. `rows_to_do`: the valid
    count when the host knows it (the grid and the vocab splits are sized from it), else N.
    """
    N, D = hidden.shape
    V = weight.shape[0]
    device = hidden.device
    rows_to_do = N if rows_to_do is None else rows_to_do
    tiles = tiles_for(hidden.dtype)
    n_tiles = triton.cdiv(V, tiles.block_v)
    splits = tiles.splits or _num_splits(rows_to_do, n_tiles, tiles.block_n, device)
    tiles_per_split = triton.cdiv(n_tiles, splits)
    splits = triton.cdiv(n_tiles, tiles_per_split)  # every split owns at least one tile
    partials = [new_buffer((splits, N), torch.float32, device) for _ in range(4)]
    grid = (splits * max(1, triton.cdiv(rows_to_do, tiles.block_n)),)
    with on_device(hidden):
        _sweep_fwd_kernel[grid](
            hidden,
            weight,
            bias,
            token_ids,
            rows,
            count,
            *partials,
            N,
            V,
            D,
            hidden.stride(0),
            weight.stride(0),
            logits.inner,
            logits.outer,
            tiles_per_split,
            splits,
            SOFTCAP=logits.softcap,
            DOT_PRECISION=dot_precision(hidden.dtype),
            DOT_UPCAST=dot_upcast(hidden.dtype),
            BLOCK_N=tiles.block_n,
            BLOCK_V=tiles.block_v,
            BLOCK_D=tiles.block_d,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
    return _combine_splits(*partials)


def _combine_splits(run_max, sumexp, shifted_pz, target):
    """Merge per-split (m, s, t, target logit) [splits, N] into lse, logp, entropy [N]."""
    if run_max.shape[0] == 1:
        m, s, t, target = run_max[0], sumexp[0], shifted_pz[0], target[0]
    else:
        m = run_max.amax(0)
        rescale = torch.exp(run_max - m)
        s = (rescale * sumexp).sum(0)
        t = (rescale * (shifted_pz - sumexp * (m - run_max))).sum(0)
        target = target.sum(0)
    log_s = torch.log(s)
    lse = m + log_s
    # H >= 0 exactly; rounding can leave a confident row at -1e-7, which is clamped away.
    entropy = (log_s - t / s).clamp(min=0.0)
    return lse, target - lse, entropy


def scoring_forward(hidden2d, weight, token_ids, bias, logits: LogitMap):
    """logp and entropy [N] float32 for every row (the forward-only entry point)."""
    N = hidden2d.shape[0]
    rows = torch.arange(N, device=hidden2d.device)
    count = torch.full((), N, dtype=torch.int64, device=hidden2d.device)
    _, logp, entropy = sweep_forward(hidden2d.contiguous(), weight.contiguous(), bias, token_ids, rows, count, logits)
    return logp, entropy
