"""Backward vocabulary sweep: recompute the logit tiles, form d(logits), apply them to W and h.

With g_t = dloss/dlogp_t and c_t = dloss/dH_t from the token stage (already multiplied
by the upstream gradient, on the device), each tile of the gradient of the logits is

    dz_{t,v} = ( g_t (1[v = y_t] - p_v) - c_t p_v (log p_v + H_t) ) / T,

with p_v = exp(z_v - lse_t) from the saved lse (times the logit scale s, and 1 - tanh^2 under a
softcap: d(head output), `spec.LogitMap`). The kernel recomputes z exactly as the
forward sweep does (`tl.dot`, fp32 accumulator) and forms dz in fp32.

Why the products with W and h are not fused into the kernel: grad_h[t] = sum_v dz W_v
reduces over V into a [BLOCK_N, D] accumulator and grad_W[v] = sum_t dz h_t into a
[BLOCK_V, D] one; with D in the thousands neither fits on chip, so a fused kernel must
either recompute the logits once per D chunk (D / BLOCK_D times the forward's work) or
accumulate through global memory with atomics (non-deterministic, and the traffic of one
[BLOCK, D] read-modify-write per tile). Instead the vocabulary is walked in chunks of
`chunk_v` columns: the kernel writes dz for one chunk ([n, chunk_v] over the n valid rows,
in their compacted order; at most N V / 32 elements), then two GEMMs consume it:

    grad_h += dz_chunk @ W_chunk              (fp32 accumulator of [n, D], summed inside the GEMM)
    grad_W[chunk] = dz_chunk^T @ h_valid      (complete per chunk: no accumulation across chunks)

Both are deterministic (no atomics) and run at GEMM speed. dz is stored in the input
dtype before the GEMMs (as PyTorch's own bf16/fp16 backward does; fp32 stays fp32). The
hidden-state product is accumulated in fp32 by the GEMM itself where torch has ``out_dtype``
(`gemm.addmm_f32_`): no 16-bit temporary and no rounding per chunk. Chunks are at least
4096 columns wide (or V/32 on smaller vocabularies) and wider while dz stays within
`CHUNK_BYTES`, and one dz buffer is reused by every chunk.

fp16 inputs: like PyTorch's own fp16 backward, d(logits) entries below fp16's range
(~6e-8) flush to zero unless the loss is scaled (torch.amp.GradScaler); bf16 has fp32's
range and needs no scaling.

Not implemented: skipping tiles whose d(logits) is negligible (Cut Cross-Entropy's
gradient filtering); every tile is computed, so the result has no filtering error.

Masked rows are not computed at all: dz, the gathered hidden rows and the hidden-state
accumulator cover only the valid rows (their count read on the host by the forward), so
masked tokens skip both GEMMs; the gradient of a masked row is zero. When the count stayed
on the device (CUDA-graph capture) every row is covered and rows past the count get
dz = 0. The bias gradient is the column sum of dz, in fp32. The weight gradient is skipped
when the weight is frozen, the hidden-state gradient when hidden needs none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..spec import LogitMap
from .gemm import addmm_f32_, on_device
from .stage_timing import stage
from .tiles import dot_precision, dot_upcast, new_buffer, tiles_for

#: cap on one chunk of dz, in bytes, above the 4096-column floor.
CHUNK_BYTES = 256 * 2**20
#: columns per chunk at least (where V/32 allows): wide enough for the GEMMs' K and few chunks.
MIN_CHUNK_COLUMNS = 4096


@triton.heuristics({"HAS_BIAS": lambda args: args["bias_ptr"] is not None})
@triton.jit(do_not_specialize=["N", "V", "v_begin", "chunk_width"])  # see tiles.py
def _dlogits_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    ids_ptr,
    rows_ptr,
    count_ptr,
    lse_ptr,
    entropy_ptr,
    g_ptr,
    c_ptr,
    dz_ptr,
    N,
    V,
    D,
    v_begin,
    chunk_width,
    stride_h,
    stride_w,
    stride_dz,
    logit_inner,
    logit_outer,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    # grouped launch order: consecutive programs take GROUP_N token blocks at one vocab tile, then
    # the next tile, so a wave of programs shares a few hidden blocks and a few weight tiles in L2
    pid = tl.program_id(0)
    v_tiles = tl.cdiv(chunk_width, BLOCK_V)
    per_group = GROUP_N * v_tiles
    first_block = (pid // per_group) * GROUP_N
    group_size = tl.minimum(tl.maximum(tl.cdiv(N, BLOCK_N), 1) - first_block, GROUP_N)  # N = 0: one block
    pid_n = (first_block + (pid % per_group) % group_size).to(tl.int64)
    pid_v = ((pid % per_group) // group_size).to(tl.int64)
    count = tl.load(count_ptr).to(tl.int64)
    start = pid_n * BLOCK_N
    idx = start + tl.arange(0, BLOCK_N)
    # the tile's columns as int32 offsets from its first one, bounded by one scalar: in the epilogue's
    # layout a thread holds a column vector's value for each of its 32 columns, two registers each
    # for an int64 vector, and at the register limit those spill
    tile_in_chunk = pid_v * BLOCK_V
    first_col = v_begin + tile_in_chunk
    tile_cols = tl.arange(0, BLOCK_V)
    col_ok = tile_cols < (tl.minimum(v_begin + chunk_width, V) - first_col).to(tl.int32)
    if start < count:
        valid = idx < count
        rows = tl.load(rows_ptr + idx, mask=valid, other=0)
        cols = first_col + tile_cols
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
            acc += tl.load(bias_ptr + first_col + tile_cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        # the epilogue's [BLOCK_N, BLOCK_V] values: log p, then p and dz in its place, and under a
        # softcap gap = 1 - |tanh x| = 2 sigmoid(-2 |x|) (x = inner a), the one value kept for the
        # derivative 1 - tanh^2 x = gap (2 - gap), exact where a logit saturates. At the register
        # limit one more such value spills (sigmoid(2x) and sigmoid(-2x) kept to the end did).
        # dz/da at tanh 0 (s / T) is folded into the per-row g and c.
        slope = logit_inner * logit_outer
        lse = tl.load(lse_ptr + rows, mask=valid, other=0.0)
        g = tl.load(g_ptr + rows, mask=valid, other=0.0) * slope
        if SOFTCAP:
            gap = 2.0 * tl.sigmoid(-2.0 * logit_inner * tl.abs(acc))
            log_p = logit_outer * tl.where(acc >= 0, 1.0 - gap, gap - 1.0) - lse[:, None]
        else:
            log_p = acc * logit_inner - lse[:, None]
        if HAS_ENTROPY_GRAD:
            entropy = tl.load(entropy_ptr + rows, mask=valid, other=0.0)
            c = tl.load(c_ptr + rows, mask=valid, other=0.0) * slope
            dz = -tl.exp(log_p) * (g[:, None] + c[:, None] * (log_p + entropy[:, None]))
        else:
            dz = -tl.exp(log_p) * g[:, None]
        targets = tl.load(ids_ptr + rows, mask=valid, other=-1)
        target_col = (targets - first_col).to(tl.int32)
        dz = tl.where(tile_cols[None, :] == target_col[:, None], dz + g[:, None], dz)
        if SOFTCAP:
            dz = dz * (gap * (2.0 - gap))
        # rows past the count: zero, whatever exp gave for their (bias-only) logits
        dz = tl.where(valid[:, None], dz, 0.0)
        out_ptrs = (dz_ptr + idx * stride_dz + tile_in_chunk)[:, None] + tile_cols[None, :]  # compacted row order
        tl.store(out_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=(idx < N)[:, None] & col_ok[None, :])
    else:
        out_ptrs = (dz_ptr + idx * stride_dz + tile_in_chunk)[:, None] + tile_cols[None, :]
        zeros = tl.zeros([BLOCK_N, BLOCK_V], dtype=dz_ptr.dtype.element_ty)
        tl.store(out_ptrs, zeros, mask=(idx < N)[:, None] & col_ok[None, :])


def chunk_width(n_rows: int, vocab: int, element_size: int, block_v: int) -> int:
    """Columns of dz per chunk: a multiple of `block_v`, at most V/32 (dz stays below N V / 32
    elements), at least `MIN_CHUNK_COLUMNS` below that, and wider while within `CHUNK_BYTES`."""
    by_memory = CHUNK_BYTES // max(1, n_rows * element_size)
    cap = min(vocab // 32, max(MIN_CHUNK_COLUMNS, by_memory))
    return max(block_v, cap // block_v * block_v)


def sweep_backward(
    grad_loss,
    hidden,
    weight,
    bias,
    token_ids,
    rows,
    count,
    lse,
    entropy,
    g,
    c,
    logits: LogitMap,
    entropy_grad: bool,
    need_weight: bool,
    need_bias: bool,
    need_hidden: bool = True,
    rows_to_do: int | None = None,
    rows_are_identity: bool = False,
):
    """(grad_hidden or None, grad_weight or None, grad_bias or None) in the input dtypes.

    `hidden` [N, D], `weight` [V, D] with unit stride along D; `rows`, `count` as from
    `sweep_fwd.compact_rows`; `lse`, `entropy`, `g`, `c` float32 [N] (zero at masked rows);
    `grad_loss` the 0-d upstream gradient (a device tensor: no sync). `rows_to_do`: the valid
    count as read on the host (None: N, every row covered); `rows_are_identity` when no row
    is masked (`rows` is then 0..N-1 and nothing is gathered).
    """
    N, D = hidden.shape
    V = weight.shape[0]
    device, dtype = hidden.device, hidden.dtype
    n = N if rows_to_do is None else rows_to_do
    tiles = tiles_for(dtype)
    g = g * grad_loss
    c = c * grad_loss
    grad_weight = torch.empty_like(weight) if need_weight else None
    grad_bias = torch.empty_like(bias) if need_bias else None
    acc = torch.zeros((n, D), dtype=torch.float32, device=device) if need_hidden else None
    h_valid = hidden if rows_are_identity else hidden.index_select(0, rows[:n])
    width = min(V, tiles.chunk_v or chunk_width(n, V, hidden.element_size(), tiles.block_v))
    dz_buffer = new_buffer((n, width), dtype, device)
    for v0 in range(0, V, width):
        cols = min(width, V - v0)
        dz = dz_buffer[:, :cols]
        grid = (max(1, triton.cdiv(n, tiles.block_n)) * triton.cdiv(cols, tiles.block_v),)
        with on_device(hidden), stage("backward d(logits)"):
            _dlogits_kernel[grid](
                hidden,
                weight,
                bias,
                token_ids,
                rows,
                count,
                lse,
                entropy,
                g,
                c,
                dz,
                n,
                V,
                D,
                v0,
                cols,
                hidden.stride(0),
                weight.stride(0),
                dz.stride(0),
                logits.inner,
                logits.outer,
                SOFTCAP=logits.softcap,
                HAS_ENTROPY_GRAD=entropy_grad,
                DOT_PRECISION=dot_precision(dtype),
                DOT_UPCAST=dot_upcast(dtype),
                BLOCK_N=tiles.block_n,
                BLOCK_V=tiles.block_v,
                BLOCK_D=tiles.block_d,
                GROUP_N=tiles.group_n,
                num_warps=tiles.num_warps,
                num_stages=tiles.num_stages,
            )
        weight_chunk = weight[v0 : v0 + cols]
        if need_hidden:
            with stage("grad_hidden GEMM"):
                addmm_f32_(acc, dz, weight_chunk)
        if need_weight:
            with stage("grad_weight GEMM"):
                torch.mm(dz.t(), h_valid, out=grad_weight[v0 : v0 + cols])
        if need_bias:
            with stage("grad_bias"):
                grad_bias[v0 : v0 + cols] = dz.sum(0, dtype=torch.float32)
    grad_hidden = None
    if need_hidden:
        if rows_are_identity:
            grad_hidden = acc.to(dtype)
        else:
            grad_hidden = torch.zeros((N, D), dtype=dtype, device=device).index_copy_(0, rows[:n], acc.to(dtype))
    return grad_hidden, grad_weight, grad_bias
