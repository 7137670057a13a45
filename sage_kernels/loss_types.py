"""The loss-type table: what each `LossConfig.loss_type` is, read by every caller.

The maths of each type lives in `reference.py` (the oracle) and the kernels; everything else
(validation, the integrations' divisors, the trainer's micro-batch normalisers, which fast path
a backend may take) reads a record here. Adding a loss type touches this table and the maths.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossType:
    """One loss type (docs/loss.md gives its formula).

    code: the kernels' compile-time constant. clipped: the PG term is PPO's clipped surrogate
    (delta_clip and dual_clip_c apply); the others replace it. aggregation: how the [B, L]
    per-token losses l (mask m) become the scalar: "sequence_mean" (Σ_t m l / Σ_t m per row,
    mean over rows), "sequence_sum" (Σ_t m l per row, mean over rows) or "token_sum"
    (Σ m l / normaliser). normaliser, token_sum only: "call_tokens" (this call's token count),
    "max_length" (B x max_completion_length) or "given_tokens" (`num_items_in_batch`, else this
    call's count: a caller may pass a count that spans more than the call). sequence_weight: the
    PG weight of a token is a function of its whole row, so the per-token gradient is not local.
    token_ratio: the type reads each token's own ratio (or forms the row's geometric mean itself), so
    `importance_sampling` must stay "token".
    """

    code: int
    clipped: bool
    aggregation: str
    normaliser: str | None = None
    sequence_weight: bool = False
    token_ratio: bool = False

    @property
    def token_local_gradient(self) -> bool:
        """dloss/dlogp_t depends on position t alone (given the batch's normaliser), for token-level
        ratios and no entropy or off-policy mask (those need the whole row or batch)."""
        return not self.sequence_weight


LOSS_TYPES = {
    "grpo": LossType(0, clipped=True, aggregation="sequence_mean"),
    "bnpo": LossType(1, clipped=True, aggregation="token_sum", normaliser="call_tokens"),
    "dr_grpo": LossType(2, clipped=True, aggregation="token_sum", normaliser="max_length"),
    "dapo": LossType(3, clipped=True, aggregation="token_sum", normaliser="given_tokens"),
    "cispo": LossType(4, clipped=False, aggregation="token_sum", normaliser="given_tokens"),
    "sapo": LossType(5, clipped=False, aggregation="sequence_mean"),
    "luspo": LossType(6, clipped=True, aggregation="sequence_sum"),
    "vespo": LossType(7, clipped=False, aggregation="token_sum", normaliser="given_tokens", sequence_weight=True),
    "gmpo": LossType(8, clipped=False, aggregation="sequence_mean", sequence_weight=True, token_ratio=True),
    "dppo_tv": LossType(9, clipped=False, aggregation="token_sum", normaliser="given_tokens", token_ratio=True),
    "dppo_kl": LossType(10, clipped=False, aggregation="token_sum", normaliser="given_tokens", token_ratio=True),
}
LOSS_TYPE_CODES = {name: kind.code for name, kind in LOSS_TYPES.items()}
