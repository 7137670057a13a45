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

    code: the kernels' compile-time constant. bounds: what eps_low and eps_high bound: "ratio"
    (PPO's clipped surrogate, 1 - eps_low <= r <= 1 + eps_high; `clipped`), "ratio_cap" (eps_high
    caps the ratio's weight: cispo), "log_ratio" (-eps_low <= log r <= eps_high: gmpo),
    "trust_region" (the change of the token's probability: dppo) or None (neither: sapo, vespo).
    options: the `LossConfig` fields only this type reads (the others must keep their defaults,
    or are ignored where a peer passes them to every type). aggregation: how the [B, L]
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
    bounds: str | None
    aggregation: str
    normaliser: str | None = None
    sequence_weight: bool = False
    token_ratio: bool = False
    options: tuple[str, ...] = ()

    @property
    def clipped(self) -> bool:
        """The PG term is PPO's clipped surrogate (delta_clip and dual_clip_c apply); the others
        replace it."""
        return self.bounds == "ratio"

    @property
    def token_local_gradient(self) -> bool:
        """dloss/dlogp_t depends on position t alone (given the batch's normaliser), for token-level
        ratios and no entropy or off-policy mask (those need the whole row or batch)."""
        return not self.sequence_weight


def per_token_grad_is_local(config) -> bool:
    """True when a `LossConfig`'s dloss/dlogp_t and dloss/dH_t depend only on position t's own logp
    and H (given the batch's normaliser): the one answer the backends' fast paths ask."""
    return (
        config.importance_sampling == "token"
        and config.top_entropy_quantile == 1.0
        and LOSS_TYPES[config.loss_type].token_local_gradient
        and config.off_policy_mask_threshold is None  # a row's mask needs all of its logp
    )


_PPO = ("delta_clip", "dual_clip_c")
_VESPO = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")

LOSS_TYPES = {
    "grpo": LossType(0, "ratio", aggregation="sequence_mean", options=_PPO),
    "bnpo": LossType(1, "ratio", aggregation="token_sum", normaliser="call_tokens", options=_PPO),
    "dr_grpo": LossType(2, "ratio", aggregation="token_sum", normaliser="max_length", options=_PPO),
    "dapo": LossType(3, "ratio", aggregation="token_sum", normaliser="given_tokens", options=_PPO),
    "cispo": LossType(4, "ratio_cap", aggregation="token_sum", normaliser="given_tokens"),
    "sapo": LossType(5, None, aggregation="sequence_mean", options=("sapo_temperature_pos", "sapo_temperature_neg")),
    "luspo": LossType(6, "ratio", aggregation="sequence_sum", options=_PPO + ("luspo_include_padding",)),
    "vespo": LossType(
        7, None, aggregation="token_sum", normaliser="given_tokens", sequence_weight=True, options=_VESPO
    ),
    "gmpo": LossType(8, "log_ratio", aggregation="sequence_mean", sequence_weight=True, token_ratio=True),
    "dppo_tv": LossType(
        9,
        "trust_region",
        aggregation="token_sum",
        normaliser="given_tokens",
        token_ratio=True,
        options=("dppo_ratio_cap",),
    ),
    "dppo_kl": LossType(
        10,
        "trust_region",
        aggregation="token_sum",
        normaliser="given_tokens",
        token_ratio=True,
        options=("dppo_ratio_cap",),
    ),
}
LOSS_TYPE_CODES = {name: kind.code for name, kind in LOSS_TYPES.items()}
