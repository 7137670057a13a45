"""``backend="cpu"``: the SAGE loss on the CPU without the [N, V] logits.

The vocabulary sweep runs one block of token rows at a time: a BLAS matmul gives the
block's logits (h W^T + b) / T (scaled and softcapped first when the config says so:
`spec.LogitMap`) in a [rows, V] workspace, one fused pass per row gives lse,
logp and the entropy, and, for training, one more fused pass turns the workspace into
d(logits) in place before two matmuls add the block's share to the hidden, weight and
bias gradients. The passes are the native operators of ``csrc/sage_cpu.cpp``
(``torch.ops.sage_cpu``), compiled on first use by `native_build` (cached per package version,
torch version and source digest; a bounded wait for another process's build, never a hang on a
killed build's lock); without a compiler, when the build fails or stays locked past the bound, or
with ``SAGE_CPU_NATIVE=0``, the same block loop runs on PyTorch operators (`_TorchBlocks`),
after one warning line.

The per-token stage (guide, KL, ratio, clipping, aggregation) is `reference.token_stage`
itself, on [B, L] tensors, so every option has the reference's exact semantics;
autograd through it (O(N) work) gives g = dloss/dlogp and c = dloss/dH. When those are
local to each token (token-level ratios, no entropy quantile, not vespo) they are known as soon as
a block's logp and H are, so the gradient is formed from the logits still in the
workspace: three matmuls in all, the minimum. Otherwise (sequence-level ratios, the
entropy quantile, vespo's row weight) a first sweep collects logp and H, and a second recomputes each block.
Either way the gradients are computed inside the forward, like Liger-Kernel's chunked
losses, and scaled by the upstream gradient in the backward.

Memory: the float32 gradients, O(N) per-token tensors, and the workspace, sized by
`block_rows` to a quarter of the LM head (the weight gradient plus at most 25%), always
below N*V/16 elements. Every block re-reads the LM head twice and reads and writes the
weight gradient once, so taller blocks are faster (benchmarks/ measures by how much).
Low-precision inputs are upcast to float32 (the valid hidden rows and the weight, once per
call) and everything accumulates in float32.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .first_order import first_order_only
from .inputs import FAST_DTYPES, SageInputs, SageLossOutput
from .loss_types import per_token_grad_is_local
from .native_build import build_extension, extension_name
from .packing import layout_of
from .reference import token_stage
from .shard_sweep import FusedShardSweep
from .spec import LogitMap, LossConfig, logit_map

_HERE = Path(__file__).resolve().parent
#: environment switch: "0" forces the PyTorch block loop even where the operator builds.
NATIVE_ENV = "SAGE_CPU_NATIVE"
#: the logits workspace may hold this fraction of the LM head's elements ...
WORKSPACE_SHARE_OF_WEIGHT = 0.25
#: ... or this many elements (16 MiB of float32), whichever is more.
WORKSPACE_MIN_ELEMENTS = 1 << 22
#: the operator's source: inside the installed package (a wheel), else the checkout's csrc/
_SOURCES = (_HERE / "csrc" / "sage_cpu.cpp", _HERE.parent / "csrc" / "sage_cpu.cpp")
_SOURCE = next((path for path in _SOURCES if path.is_file()), _SOURCES[-1])
# Instruction-set flags per torch CPU capability; the capability is part of the extension's name
# (`extension_name`), so a cache shared between machines never loads code built for a richer one.
_ISA_FLAGS = {
    "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512"],
    "AVX2": ["-mavx2", "-mfma"],
}
_native_state: dict = {}


def native_ops():
    """``torch.ops.sage_cpu`` once the extension is built and loaded, else None (one warning)."""
    if "ops" not in _native_state:
        capability = torch.backends.cpu.get_cpu_capability()
        loaded = build_extension(_SOURCE, extension_name(_SOURCE, capability), _ISA_FLAGS.get(capability, []))
        _native_state["ops"] = torch.ops.sage_cpu if loaded else None
    return _native_state["ops"]


def _ops_for(native: bool | None):
    """The block operators: native (True: required), PyTorch (False), or by `NATIVE_ENV` (None)."""
    if native is None:
        native = os.environ.get(NATIVE_ENV, "1") != "0" and native_ops() is not None
    if not native:
        return _TorchBlocks
    ops = native_ops()
    if ops is None:
        raise RuntimeError("native=True, but the sage_cpu operator could not be built (see the warning above)")
    return ops


class _TorchBlocks:
    """The two block operators of csrc/sage_cpu.cpp in PyTorch operators (same signatures)."""

    @staticmethod
    def block_stats(hidden, weight, bias, targets, inner, outer, softcap, logits, logp, entropy, lse):
        torch.mm(hidden, weight.t(), out=logits)
        if bias is not None:
            logits.add_(bias)
        logits.mul_(inner)  # under a softcap the workspace keeps tanh's argument x, as the operator's does
        z = logits.tanh().mul_(outer) if softcap else logits
        torch.logsumexp(z, 1, out=lse)
        log_p = z - lse[:, None]
        # p log p is 0 where p is: a logit of -inf (a finfo.min bias over T < 1) gives 0 * -inf = NaN. Only
        # there: a logit of +inf (an overflow) leaves NaN, as the native operator does, for the caller to refuse
        entropy.copy_(-torch.where(torch.isneginf(log_p), 0.0, log_p.exp() * log_p).sum(1))
        logp.copy_(log_p.gather(1, targets[:, None]).squeeze(1))

    @staticmethod
    def block_grad(
        logits,
        targets,
        lse,
        entropy,
        grad_logp,
        grad_entropy,
        inner,
        outer,
        softcap,
        hidden,
        weight,
        grad_hidden,
        grad_weight,
        grad_bias,
    ):
        slope = inner
        if softcap:  # the workspace holds x: z = outer tanh x, dz/da = inner outer / cosh^2 x (no cancellation)
            slope = logits.cosh().reciprocal_().square_().mul_(inner * outer)
            logits.tanh_().mul_(outer)
        log_p = logits.sub_(lse[:, None])
        weight_per_p = (log_p + entropy[:, None]).mul_(grad_entropy[:, None]).add_(grad_logp[:, None])
        # where it is not finite (c log p overflowed, or c = 0 times log p = -inf), p is 0 and so is d z
        weight_per_p.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        d_logits = log_p.exp_().mul_(weight_per_p).neg_()  # -p (g + c (log p + H)), in the workspace
        d_logits.scatter_add_(1, targets[:, None], grad_logp[:, None])
        d_logits.mul_(slope)
        if grad_hidden is not None:
            torch.mm(d_logits, weight, out=grad_hidden)
        if grad_weight is not None:
            grad_weight.addmm_(d_logits.t(), hidden)
        if grad_bias is not None:
            grad_bias.add_(d_logits.sum(0))


def block_rows(total_rows: int, valid_rows: int, vocab: int, hidden_size: int) -> int:
    """Rows per block: the [rows, V] workspace stays below N*V/16 elements and within its budget."""
    below_limit = (total_rows * vocab // 16 - 1) // vocab
    budget = max(int(WORKSPACE_SHARE_OF_WEIGHT * vocab * hidden_size), WORKSPACE_MIN_ELEMENTS)
    return max(1, min(valid_rows, below_limit, budget // vocab))


def _as_float32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(torch.float32).contiguous()


class _Sweep:
    """One call's block loop over the valid rows; owns the workspace and the float32 buffers."""

    def __init__(self, hidden2d, weight, bias, targets, rows, logits: LogitMap, ops, total_rows):
        self.ops = ops
        self.weight = _as_float32(weight)
        self.bias = _as_float32(bias)
        self.hidden = _as_float32(hidden2d if rows is None else hidden2d.index_select(0, rows))
        self.targets = (targets if rows is None else targets.index_select(0, rows)).contiguous()
        n, (vocab, hidden_size) = self.hidden.shape[0], self.weight.shape
        self.logit_map = logits
        step = block_rows(total_rows, n, vocab, hidden_size)
        step = -(-n // -(-n // step)) if n else step  # as many blocks, evened out: no thin last block
        self.blocks = [slice(start, min(start + step, n)) for start in range(0, n, step)]
        self.logits = torch.empty(step if n else 0, vocab, dtype=torch.float32)
        # zero-filled: the per-token stage may read rows a block loop has not reached yet
        self.logp, self.entropy, self.lse = (torch.zeros(n, dtype=torch.float32) for _ in range(3))

    def stats(self, block: slice) -> torch.Tensor:
        """Fill logp, entropy and lse of `block`; returns the workspace holding its logits."""
        logits = self.logits[: block.stop - block.start]
        self.ops.block_stats(
            self.hidden[block],
            self.weight,
            self.bias,
            self.targets[block],
            *self.logit_map,
            logits,
            self.logp[block],
            self.entropy[block],
            self.lse[block],
        )
        return logits

    def grad(self, block: slice, logits, grad_logp, grad_entropy, grad_hidden, grad_weight, grad_bias) -> None:
        """Add the block's share of the gradients, given g and c of its rows (consumes `logits`)."""
        self.ops.block_grad(
            logits,
            self.targets[block],
            self.lse[block],
            self.entropy[block],
            grad_logp[block].contiguous(),
            grad_entropy[block].contiguous(),
            *self.logit_map,
            self.hidden[block],
            self.weight,
            None if grad_hidden is None else grad_hidden[block],
            grad_weight,
            grad_bias,
        )


def _stage_with_grads(logp, entropy, inputs, config):
    """`token_stage` on the [B, L] grid and its gradients g, c with respect to logp and entropy."""
    logp = logp.detach().requires_grad_(True)
    entropy = entropy.detach().requires_grad_(True)
    with torch.enable_grad():
        loss, per_token = token_stage(logp, entropy, inputs, config)
        g, c = torch.autograd.grad(loss, (logp, entropy), allow_unused=True, materialize_grads=True)
    return loss.detach(), per_token, g, c


def _run(inputs: SageInputs, config: LossConfig, ops, need: dict):
    """The sweep and the per-token stage. `need` says which gradients to form (hidden, weight, bias).

    Returns (loss, logp [B, L], entropy [B, L], per_token, grads dict or None). The sweep walks the
    N hidden rows; the per-token stage sees them on its [B, L] grid (`packing.TokenLayout`).
    """
    layout = layout_of(inputs)
    N = inputs.hidden.shape[0]
    # only the positions that enter the loss are swept (all of them under luspo_include_padding)
    flat_mask = layout.to_rows(inputs.loss_mask)
    rows = None if bool(flat_mask.all()) else flat_mask.nonzero().squeeze(1)
    sweep = _Sweep(
        inputs.hidden, inputs.weight, inputs.bias, layout.to_rows(inputs.token_ids), rows, config.logit_map, ops, N
    )
    logp = torch.zeros(N, dtype=torch.float32)
    entropy = torch.zeros(N, dtype=torch.float32)

    def gather_valid(t: torch.Tensor) -> torch.Tensor:
        return layout.to_rows(t) if rows is None else layout.to_rows(t).index_select(0, rows)

    def stage(with_grads: bool):
        """token_stage on everything swept so far: (loss, per_token, g and c at the valid rows)."""
        for full, part in ((logp, sweep.logp), (entropy, sweep.entropy)):
            if rows is None:
                full.copy_(part)
            else:
                full.index_copy_(0, rows, part)
        if not with_grads:
            loss, per_token = token_stage(layout.to_grid(logp), layout.to_grid(entropy), inputs, config)
            return loss, per_token, None, None
        loss, per_token, g, c = _stage_with_grads(layout.to_grid(logp), layout.to_grid(entropy), inputs, config)
        return loss, per_token, gather_valid(g), gather_valid(c)

    if not any(need.values()):
        for block in sweep.blocks:
            sweep.stats(block)
        loss, per_token, _, _ = stage(with_grads=False)
        return loss, layout.to_grid(logp), layout.to_grid(entropy), per_token, None

    grads = {
        "hidden": torch.empty_like(sweep.hidden) if need["hidden"] else None,
        "weight": torch.zeros_like(sweep.weight) if need["weight"] else None,
        "bias": torch.zeros_like(sweep.bias) if need["bias"] else None,
    }
    if per_token_grad_is_local(config):
        # g and c of a block's rows are exact once its own logp and H are in: use the workspace now.
        for block in sweep.blocks:
            logits = sweep.stats(block)
            _, _, g, c = stage(with_grads=True)
            sweep.grad(block, logits, g, c, grads["hidden"], grads["weight"], grads["bias"])
    else:
        # The entropy quantile or the sequence-level ratio needs every row first: a second sweep.
        for block in sweep.blocks:
            sweep.stats(block)
        _, _, g, c = stage(with_grads=True)
        for block in sweep.blocks:
            sweep.grad(block, sweep.stats(block), g, c, grads["hidden"], grads["weight"], grads["bias"])
    loss, per_token, _, _ = stage(with_grads=False)
    return loss, layout.to_grid(logp), layout.to_grid(entropy), per_token, _finish_grads(grads, rows, N, inputs)


def _finish_grads(grads: dict, rows, N: int, inputs: SageInputs) -> dict:
    """Valid-row gradients back to all N rows (zeros under the mask), in the inputs' dtypes."""
    grad_hidden = grads["hidden"]
    if grad_hidden is not None and rows is not None:
        valid = grad_hidden
        grad_hidden = torch.zeros(N, valid.shape[1], dtype=torch.float32).index_copy_(0, rows, valid)
    out = {"hidden": None if grad_hidden is None else grad_hidden.to(inputs.hidden.dtype)}
    out["weight"] = None if grads["weight"] is None else grads["weight"].to(inputs.weight.dtype)
    out["bias"] = None if grads["bias"] is None else grads["bias"].to(inputs.bias.dtype)
    return out


class SageCpuLoss(torch.autograd.Function):
    """Loss forward with the gradients formed during the sweep; backward scales them by dloss."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, inputs: SageInputs, config: LossConfig, ops, side: dict):
        need = {
            "hidden": ctx.needs_input_grad[0],
            "weight": ctx.needs_input_grad[1],
            "bias": bias is not None and ctx.needs_input_grad[2],
        }
        loss, logp, entropy, per_token, grads = _run(inputs, config, ops, need)
        side.update(logp=logp, entropy=entropy, per_token=per_token)
        ctx.grads = grads
        return loss

    @staticmethod
    @first_order_only("cpu backend")
    def backward(ctx, grad_loss):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError(
                "sage_kernels cpu backend: backward called twice on one loss "
                "(its gradients are formed in the forward and handed over once)"
            )
        scaled = [
            None if g is None else (g if bool(grad_loss == 1) else g * grad_loss.to(g.dtype))
            for g in (grads["hidden"], grads["weight"], grads["bias"])
        ]
        return (*scaled, None, None, None, None)


def sage_loss(inputs: SageInputs, config: LossConfig, native: bool | None = None) -> SageLossOutput:
    """The loss of docs/loss.md on the CPU. `native`: True requires the csrc operator, False runs the
    PyTorch block loop, None (the backend interface) uses the operator unless ``SAGE_CPU_NATIVE=0``."""
    side: dict = {}
    ops = _ops_for(native)
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (inputs.hidden, inputs.weight, inputs.bias)
    ):
        loss = SageCpuLoss.apply(inputs.hidden, inputs.weight, inputs.bias, inputs, config, ops, side)
    else:
        loss, logp, entropy, per_token, _ = _run(inputs, config, ops, {"hidden": False, "weight": False, "bias": False})
        side.update(logp=logp, entropy=entropy, per_token=per_token)
    per_token, mask = side["per_token"], inputs.loss_mask
    return SageLossOutput(
        loss=loss,
        logp=torch.where(mask, side["logp"], 0.0),
        entropy=torch.where(mask, side["entropy"], 0.0),
        q=per_token["q"],
        kl=per_token["kl"],
        ratio=per_token["ratio"],
        metrics=per_token["metrics"],
    )


def logprobs_and_entropy(
    hidden2d, weight, token_ids_flat, bias, temperature, logit_scale=1.0, logit_softcap=None, native: bool | None = None
):
    """Float32 log-prob of each token and entropy of its row, block by block, without gradient."""
    n = hidden2d.shape[0]
    logits = logit_map(temperature, logit_scale, logit_softcap)
    sweep = _Sweep(hidden2d, weight, bias, token_ids_flat, None, logits, _ops_for(native), n)
    for block in sweep.blocks:
        sweep.stats(block)
    return sweep.logp, sweep.entropy


#: the dtypes of hidden and weight this backend takes (`backends.Backend`).
DTYPES = FAST_DTYPES


def shard_stats(hidden2d, weight, bias, token_ids, temperature: float):
    """(lse, logp, entropy) [n] over one vocabulary shard (`backends.Backend`), float32."""
    return FusedShardSweep.apply(hidden2d, weight, bias, token_ids, float(temperature), _ShardSweep)


class _ShardSweep:
    """The block loop (`_Sweep`) over every row of one vocabulary shard, forward and backward."""

    def __init__(self, hidden2d, weight, bias, token_ids, temperature):
        n = hidden2d.shape[0]
        self.sweep = _Sweep(hidden2d, weight, bias, token_ids, None, logit_map(temperature), _ops_for(None), n)

    def forward(self):
        for block in self.sweep.blocks:
            self.sweep.stats(block)
        # copies: the backward's recomputation rewrites the sweep's buffers
        return self.sweep.lse.clone(), self.sweep.logp.clone(), self.sweep.entropy.clone()

    def backward(self, g, c, need_hidden, need_weight, need_bias):
        sweep = self.sweep
        grad_hidden = torch.empty_like(sweep.hidden) if need_hidden else None
        grad_weight = torch.zeros_like(sweep.weight) if need_weight else None
        grad_bias = torch.zeros_like(sweep.bias) if need_bias else None
        for block in sweep.blocks:
            sweep.grad(block, sweep.stats(block), g, c, grad_hidden, grad_weight, grad_bias)
        return grad_hidden, grad_weight, grad_bias
