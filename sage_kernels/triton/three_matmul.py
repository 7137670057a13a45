"""The token-local fast path: three matmuls in all (6 N D V FLOP), the logits never [N, V].

When dloss/dlogp_t and dloss/dH_t depend only on token t's own logp and H (token-level
ratios, a loss type without a sequence weight, no entropy quantile or off-policy mask), a token's
gradient is known as soon as its row of logits is, so the logits need not be recomputed
in a backward sweep (the two-pass path's fourth matmul). The valid tokens (compacted,
valid first) are walked in chunks of T rows; per chunk:

1. cuBLAS: z = h_chunk W^T into a reused fp32 [T, V] workspace (fp32 out, never rounded
   to bf16; `gemm.mm_f32`);
2. Triton, one program per token: lse, logp and the entropy from the row (`_row_stats_kernel`,
   the online update of `sweep_fwd`);
3. the per-token stage (`token_stage.token_stage`, unchanged, on the whole batch: it is O(N)
   and its g, c of this chunk's tokens are exact because they are local);
4. Triton, one program per token: d(logits) from g, c and the row, written over the row in
   place in the input dtype (`_dlogits_in_place_kernel`);
5. cuBLAS: grad_h[chunk] = dz W (K = V, fp32 out; where its [T, D] output tiles are too few for
   the SMs, a batched product over 4-8 vocabulary slices into fp32 partials, then their sum:
   `gemm.sliced_mm_f32`), grad_W += dz^T h_chunk (accumulated inside the GEMM, beta = 1),
   grad_b += column sums of dz (fp32).

The gradients are formed in the forward, as the CPU backend and Liger-Kernel's chunked
losses do; the backward scales them by the upstream gradient in place. Masked tokens are
never computed: the chunks cover only `count` valid rows.

grad_W accumulates over the token chunks. An fp32 [V, D] accumulator costs 4 V D bytes,
more than the whole extra-memory budget at a 7B head and N = 16k (2 GiB against ~0.6), so
there, for 16-bit weights, the running sum is kept in the weight's dtype (like Liger-Kernel
and PyTorch's own chunked losses) and rounded once per chunk (cuBLAS computes each update
in fp32); the chunk is as tall as the workspace allows, so there are few of them (N/T,
about 26 at N = 16k on a 152k vocabulary) and never more than `MAX_CHUNKS` (32). From
N = 16 D on (about 57k tokens at D = 3584), where the accumulator is below N V / 16 elements,
it is fp32,
summed inside the GEMM (`gemm.addmm_f32_`) and rounded once at the end. The price of the
rounding per chunk grows like the square root of the chunk count: a CPU simulation with random
inputs (bf16, 16k tokens, rounded after each of 26 chunks) gave a max relative error in dW of
about 1.3% against 0.23% for a single rounding (the bf16 tolerance is 3%); fewer chunks at
N = 16k would take a taller fp32 [T, V] workspace than the memory budget allows, so the
whole-point check of `benchmarks/parity.py` measures the error at the real point.

In-place d(logits): a token's dz (2 bytes per entry for bf16) is written over the
first half of its own fp32 row, so row r of dz starts where row r of z does and the
[T, V] dz matrix has row stride 2V elements, which cuBLAS takes as its leading dimension.
Within a row, block [v0, v0 + BV) writes bytes that hold fp32 entries below v0 + BV/2,
which were all read in this block or an earlier one; a barrier between each block's loads
and stores keeps one warp from overwriting entries another warp has not read yet, and
later blocks only read entries that no store has reached.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..loss_types import per_token_grad_is_local
from ..packing import layout_of
from ..spec import LossConfig
from . import token_stage
from .boundary import GradsWanted, LossTensors, RowOrder
from .gemm import addmm_f32_, mm_f32, on_device, sliced_mm_f32, vocab_slices
from .stage_timing import stage
from .sweep_fwd import NEG_START, head_logits
from .tiles import new_buffer, tiles_for

#: paths taken by the loss forward, by name ("three-matmul", "two-pass"): tests read it.
PATHS_TAKEN: Counter = Counter()
#: bytes of the fp32 logits workspace while N needs at most `MAX_CHUNKS` chunks (about 0.6% of
#: the naive loss's memory at N = 16k on a 152k vocabulary).
WORKSPACE_BYTES = 384 * 2**20
#: token chunks at most (at large N the chunks grow taller instead): a 16-bit weight gradient is
#: rounded once per chunk.
MAX_CHUNKS = 32
#: workspace rows come in multiples of this (GEMM-friendly M).
ROW_MULTIPLE = 64

#: d(logits) dtypes; fp16 takes the two-pass path (`ops.takes_three_matmul_path`: loss scaling)
_DZ_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}


def exact_for(config: LossConfig) -> bool:
    """True when the three-matmul path is exact for `config`: every configuration whose per-token
    gradient is local (`loss_types.per_token_grad_is_local`: a token's g and c are final once its own
    row of logits is), whatever the loss type, except luspo_include_padding, whose padded rows enter
    the loss while this path covers only the valid ones."""
    return per_token_grad_is_local(config) and not config.luspo_include_padding


@triton.heuristics({"HAS_BIAS": lambda args: args["bias_ptr"] is not None})
@triton.jit(do_not_specialize=["row_begin"])  # V specialises: see tiles.py
def _row_stats_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    rows_ptr,
    count_ptr,
    lse_ptr,
    logp_ptr,
    entropy_ptr,
    row_begin,
    V,
    stride_z,
    logit_inner,
    logit_outer,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    local = tl.program_id(0).to(tl.int64)
    idx = row_begin + local
    if idx < tl.load(count_ptr):
        row = tl.load(rows_ptr + idx)
        target_id = tl.load(ids_ptr + row)
        z_row = logits_ptr + local * stride_z
        run_max = tl.full([BLOCK_V], NEG_START, dtype=tl.float32)
        sumexp = tl.zeros([BLOCK_V], dtype=tl.float32)
        shifted_pz = tl.zeros([BLOCK_V], dtype=tl.float32)
        target = tl.zeros([BLOCK_V], dtype=tl.float32)
        # lane-wise online statistics (each lane its own running max), merged once at the end:
        # no cross-lane reduction inside the loop.
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            ok = cols < V
            z = tl.load(z_row + cols, mask=ok, other=0.0)
            if HAS_BIAS:
                z += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            z = tl.where(ok, head_logits(z, logit_inner, logit_outer, SOFTCAP), NEG_START)
            new_max = tl.maximum(run_max, z)
            rescale = tl.exp(run_max - new_max)
            shifted = z - new_max
            e = tl.where(ok, tl.exp(shifted), 0.0)
            shifted_pz = rescale * (shifted_pz - sumexp * (new_max - run_max)) + e * shifted
            sumexp = rescale * sumexp + e
            run_max = new_max
            target += tl.where(cols == target_id, z, 0.0)
        m = tl.max(run_max, axis=0)
        rescale = tl.exp(run_max - m)
        s = tl.sum(rescale * sumexp, axis=0)
        t = tl.sum(rescale * (shifted_pz - sumexp * (m - run_max)), axis=0)
        log_s = tl.log(s)
        lse = m + log_s
        tl.store(lse_ptr + row, lse)
        tl.store(logp_ptr + row, tl.sum(target, axis=0) - lse)
        # H >= 0 exactly; rounding can leave a confident row at -1e-7, which is clamped away.
        tl.store(entropy_ptr + row, tl.maximum(log_s - t / s, 0.0))


@triton.heuristics({"HAS_BIAS": lambda args: args["bias_ptr"] is not None})
@triton.jit(do_not_specialize=["row_begin"])  # V specialises: see tiles.py
def _dlogits_in_place_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    rows_ptr,
    count_ptr,
    lse_ptr,
    entropy_ptr,
    g_ptr,
    c_ptr,
    row_begin,
    V,
    stride_z,
    logit_inner,
    logit_outer,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    DZ: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    local = tl.program_id(0).to(tl.int64)
    idx = row_begin + local
    z_row = logits_ptr + local * stride_z
    dz_row = z_row.to(tl.pointer_type(DZ), bitcast=True)  # same first byte as the fp32 row
    if idx < tl.load(count_ptr):
        row = tl.load(rows_ptr + idx)
        target_id = tl.load(ids_ptr + row)
        lse = tl.load(lse_ptr + row)
        slope = logit_inner * logit_outer  # dz/da where tanh is 0: s / T
        g = tl.load(g_ptr + row)
        if HAS_ENTROPY_GRAD:
            entropy = tl.load(entropy_ptr + row)
            c = tl.load(c_ptr + row)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            ok = cols < V
            z = tl.load(z_row + cols, mask=ok, other=0.0)
            if HAS_BIAS:
                z += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            if SOFTCAP:  # tanh x = 2 up - 1, 1 - tanh^2 x = 4 up down (no cancellation where a logit saturates)
                up = tl.sigmoid(2.0 * logit_inner * z)
                down = tl.sigmoid(-2.0 * logit_inner * z)
                log_p = logit_outer * (2.0 * up - 1.0) - lse
            else:
                log_p = z * logit_inner - lse
            p = tl.exp(log_p)
            dz = g * ((cols == target_id).to(tl.float32) - p)
            if HAS_ENTROPY_GRAD:
                dz -= c * p * (log_p + entropy)
            if SOFTCAP:
                dz = dz * (4.0 * up * down)
            tl.debug_barrier()  # every warp has read this block before any warp overwrites it
            tl.store(dz_row + cols, (dz * slope).to(DZ), mask=ok)
    else:
        # rows past the valid count (only when the count stayed on the device) add nothing
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            tl.store(dz_row + cols, tl.zeros([BLOCK_V], dtype=DZ), mask=cols < V)


def stage_of_tokens(logp, entropy, tensors, config) -> token_stage.StageOutputs:
    """`token_stage.token_stage` on the per-row [N] logp and entropy put on the [B, L] grid, with g
    and c back in the rows' order."""
    layout = layout_of(tensors)
    out = token_stage.token_stage(layout.to_grid(logp), layout.to_grid(entropy), tensors, config)
    return out._replace(g=layout.to_rows(out.g), c=layout.to_rows(out.c))


class FusedResult(NamedTuple):
    """`fused_loss`'s result: logp and entropy flat [N] (zero at masked rows), the token stage's
    outputs, and the gradients (None where not wanted)."""

    logp: torch.Tensor
    entropy: torch.Tensor
    stage: token_stage.StageOutputs
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None
    grad_bias: torch.Tensor | None


def _weight_accumulator_dtype(dtype: torch.dtype, n_rows: int, hidden_size: int) -> torch.dtype:
    """float32 when an fp32 [V, D] accumulator stays below N V / 16 elements (D < N/16: many
    chunks, and a large naive footprint to compare with), else the weight's own dtype."""
    return torch.float32 if hidden_size < n_rows // 16 else dtype


def chunk_rows(total_rows: int, rows_to_do: int, vocab: int) -> int:
    """Tokens per chunk: the fp32 [T, V] workspace within `WORKSPACE_BYTES`, or taller where N needs
    more than `MAX_CHUNKS` such chunks (a bound on the roundings of a 16-bit grad_W sum; the
    workspace, about N V / 8 bytes then, stays under 0.5% of the naive loss's memory), always below
    N V / 16 elements (the no-logits bound the memory test checks), evened out over the chunks."""
    tiles = tiles_for(torch.float32)
    if tiles.chunk_n:
        return tiles.chunk_n
    by_count = triton.cdiv(triton.cdiv(total_rows, MAX_CHUNKS), ROW_MULTIPLE) * ROW_MULTIPLE
    cap = min(max(WORKSPACE_BYTES // (4 * vocab), by_count), max(1, (total_rows - 1) // 16))
    if cap >= ROW_MULTIPLE:
        cap = cap // ROW_MULTIPLE * ROW_MULTIPLE
    chunks = triton.cdiv(max(rows_to_do, 1), cap)
    return min(cap, triton.cdiv(triton.cdiv(max(rows_to_do, 1), chunks), 16) * 16)


def fused_loss(tensors: LossTensors, config: LossConfig, order: RowOrder, wanted: GradsWanted) -> FusedResult:
    """Loss forward with the gradients of the three-matmul path, every launch on the tensors' GPU.

    `tensors` as `LossTensors.for_kernels` leaves them (hidden [N, D]); `order` the rows to cover
    (`boundary.row_order`: `n` the valid count read on the host, or N when it stayed on the device).
    """
    with on_device(tensors.hidden):
        return _fused_loss(tensors, config, order, wanted)


def _fused_loss(tensors: LossTensors, config: LossConfig, order: RowOrder, wanted: GradsWanted) -> FusedResult:
    hidden, weight, bias = tensors.hidden, tensors.weight, tensors.bias
    token_ids = layout_of(tensors).to_rows(tensors.token_ids)
    rows, count, rows_to_do, rows_are_identity = order.rows, order.count, order.n, order.identity
    need_hidden, need_weight, need_bias = wanted
    N, D = hidden.shape
    V = weight.shape[0]
    device, dtype = hidden.device, hidden.dtype
    tiles = tiles_for(dtype)
    want_grads = need_hidden or need_weight or need_bias
    PATHS_TAKEN["three-matmul"] += 1
    # zero, not poisoned: the per-token stage reads rows that later chunks have not reached yet
    logp, entropy, lse = (torch.zeros(N, dtype=torch.float32, device=device) for _ in range(3))
    grad_hidden = grad_weight = grad_bias = None
    if need_hidden:
        grad_hidden = (torch.empty if rows_are_identity else torch.zeros)((N, D), dtype=dtype, device=device)
    if need_weight:
        grad_weight = torch.zeros((V, D), dtype=_weight_accumulator_dtype(dtype, N, D), device=device)
    if need_bias:
        grad_bias = torch.zeros(V, dtype=torch.float32, device=device)
    step = chunk_rows(N, rows_to_do, V)
    workspace = new_buffer((min(step, rows_to_do), V), torch.float32, device) if rows_to_do else None
    grad_h_chunk = None  # fp32 [T, D]: the GEMM's output before the cast or the scatter to masked order
    if need_hidden and rows_to_do and not (dtype == torch.float32 and rows_are_identity):
        grad_h_chunk = new_buffer((min(step, rows_to_do), D), torch.float32, device)
    # d(hidden) over vocabulary slices where its [T, D] output tiles alone would not fill the SMs
    slices = (tiles.dh_slices or vocab_slices(device, dtype, min(step, rows_to_do), D, V)) if need_hidden else 1
    partial_space = new_buffer((slices * min(step, rows_to_do) * D,), torch.float32, device) if slices > 1 else None
    per_token = None
    logits = config.logit_map
    weight_t = weight.t()
    for begin in range(0, rows_to_do, step):
        t = min(step, rows_to_do - begin)
        with stage("logits GEMM"):
            h = hidden[begin : begin + t] if rows_are_identity else hidden.index_select(0, rows[begin : begin + t])
            z = workspace[:t]
            mm_f32(h, weight_t, out=z)
        with stage("row stats"):
            _row_stats_kernel[(t,)](
                z,
                bias,
                token_ids,
                rows,
                count,
                lse,
                logp,
                entropy,
                begin,
                V,
                z.stride(0),
                logits.inner,
                logits.outer,
                SOFTCAP=logits.softcap,
                BLOCK_V=tiles.row_block_v,
                num_warps=4,
            )
        if not want_grads:
            continue
        with stage("token stage"):
            per_token = stage_of_tokens(logp, entropy, tensors, config)
        with stage("d(logits)"):
            _dlogits_in_place_kernel[(t,)](
                z,
                bias,
                token_ids,
                rows,
                count,
                lse,
                entropy,
                per_token.g,
                per_token.c,
                begin,
                V,
                z.stride(0),
                logits.inner,
                logits.outer,
                SOFTCAP=logits.softcap,
                HAS_ENTROPY_GRAD=config.entropy_coef != 0.0,
                DZ=_DZ_DTYPES[dtype],
                BLOCK_V=tiles.row_block_v,
                num_warps=4,
            )
        dz = z.view(dtype)[:, :V]  # row stride 4V / itemsize elements: the fp32 row's bytes
        if need_hidden:
            with stage("grad_hidden GEMM"):
                partials = None if partial_space is None else partial_space[: slices * t * D].view(slices, t, D)
                if grad_h_chunk is None:  # fp32, nothing masked: straight into the gradient
                    sliced_mm_f32(dz, weight, grad_hidden[begin : begin + t], partials)
                elif rows_are_identity:
                    grad_hidden[begin : begin + t].copy_(sliced_mm_f32(dz, weight, grad_h_chunk[:t], partials))
                else:
                    block = sliced_mm_f32(dz, weight, grad_h_chunk[:t], partials)
                    grad_hidden.index_copy_(0, rows[begin : begin + t], block.to(dtype))
        if need_weight:
            with stage("grad_weight GEMM"):
                if grad_weight.dtype == dtype:
                    grad_weight.addmm_(dz.t(), h)
                else:
                    addmm_f32_(grad_weight, dz.t(), h)
        if need_bias:
            with stage("grad_bias"):
                grad_bias += dz.sum(0, dtype=torch.float32)
    if per_token is None or not want_grads:
        # no chunk ran the stage (no gradient wanted, or no valid token): once, on everything
        with stage("token stage"):
            per_token = stage_of_tokens(logp, entropy, tensors, config)
    if grad_bias is not None:
        grad_bias = grad_bias.to(dtype)
    if grad_weight is not None:
        grad_weight = grad_weight.to(dtype)
    return FusedResult(logp, entropy, per_token, grad_hidden, grad_weight, grad_bias)
