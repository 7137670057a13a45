"""verl adapters: the fused log-prob/entropy kernel, the SAGE anchor, and a registered policy loss.

verl's hooks see the SAGE loss in three places, and this module fills each:

- `linear_cross_entropy` and `patch_verl_fused_kernel`: verl's fused-kernel interface, per-token
  log-probs and entropies without [N, V] logits, and where verl 0.9.1 looks it up
  (`verl_kernel.py` says which paths that reaches).
- `compute_rollout_corr_metrics`: verl's ``rollout_corr/*`` mismatch metrics, every name of its
  ``compute_offpolicy_metrics`` and ``compute_is_metrics`` (`sage_kernels.rollout_corr`).
- `sage_anchor_log_prob(ref_log_prob, entropy, response_mask)`: log(q * pi_ref). Put in
  place of the batch's ``ref_log_prob`` (entropy from the old-log-prob pass), verl's own KL
  loss (``use_kl_loss=True``, ``kl_loss_type="low_var_kl"``, i.e. k3) becomes the KL to the
  SAGE anchor. The guide is then computed from the behaviour policy's entropy and held
  fixed for the update, which equals the fused loss's guide on the first on-policy step.
- `compute_policy_loss_sage`: registered as ``"sage"`` in verl's policy-loss registry
  (``actor.policy_loss.loss_mode=sage``) when verl imports; `compute_policy_loss_sage_sapo`
  likewise as ``"sage_sapo"``, the loss type verl and TRL define alike (verl's ``"sapo"``:
  ``tau_pos``/``tau_neg`` from the actor config, sequence-mean aggregation), and
  `compute_policy_loss_sage_dppo_tv` / `_kl` as ``"sage_dppo_tv"`` / ``"sage_dppo_kl"`` (verl's
  ``dppo_tv`` / ``dppo_kl``: the thresholds from ``clip_ratio_low`` / ``clip_ratio_high``, the ratio
  cap from ``clip_ratio_c``, 20 by default, as verl reads them), and
  `compute_policy_loss_sage_bypass` as ``"sage_bypass"`` (verl's ``"bypass_mode"``, old_log_prob =
  the rollout log-probs, ``loss_type="ppo_clip"``). verl's ``cispo``
  clips the ratio on both sides (TRL's caps it above only) and its ``gspo`` differentiates a
  per-token combined ratio, so neither maps onto this loss's definitions. verl passes a policy loss only
  log-probs, so it is the PG term of ``docs/loss.md`` (the same per-token stage as the
  fused loss) with verl's aggregation modes and metric names; the anchor enters through
  the KL loss above.

Inputs (`check_policy_inputs`): every per-token tensor has log_prob's shape [B, L], advantages
too (verl's are per token); any other shape is refused naming the argument, where verl's own losses
would broadcast a [B] or [1, L] tensor. With no token masked in (an all-zero `response_mask`) a
loss is 0 with zero gradients and its metrics are 0.

Differences from verl's "vanilla" and "sapo" losses: the log-ratio is not clamped to [-20, 20] before
exp; dual clip applies only when ``clip_ratio_c`` is set (verl's default 3.0 is used when
the config has no such key, as in verl).
"""

from __future__ import annotations

import torch

from .. import rollout_corr
from ..guides import branch_guide
from ..inputs import SageInputs, check_finite, check_tensor
from ..packing import on_grid, packed_layout
from ..reference import dppo_trust_region, policy_gradient_term
from ..spec import LossConfig
from .verl_kernel import linear_cross_entropy, patch_verl_fused_kernel  # noqa: F401  (the adapter exports them)

_DEFAULTS = LossConfig()
AGGREGATION_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def sage_anchor_log_prob(
    ref_log_prob: torch.Tensor,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = _DEFAULTS.gamma,
    tau: float = _DEFAULTS.tau,
    q_min: float = _DEFAULTS.q_min,
    q_max: float = _DEFAULTS.q_max,
) -> torch.Tensor:
    """log(q * pi_ref) per token with the branch guide q = clamp(1 + gamma (H - tau)+, q_min, q_max),
    by default with `LossConfig`'s guide parameters.

    Masked positions keep `ref_log_prob` (q = 1). No gradient flows through the result.
    """
    q = branch_guide(entropy.float(), gamma=gamma, tau=tau, q_min=q_min, q_max=q_max)
    return torch.where(response_mask.bool(), ref_log_prob.detach().float() + q.log(), ref_log_prob.float())


def _config_value(config, name: str, default):
    value = config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)
    return default if value is None else value


def _aggregation_weights(
    mask: torch.Tensor,
    mode: str,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> torch.Tensor:
    """Per-token weights w with verl's ``agg_loss(l, mask, mode) == sum(w * l)`` over unmasked tokens."""
    m = mask.float()
    B, L = m.shape
    if mode == "token-mean":
        tokens = m.sum() if batch_num_tokens is None else torch.as_tensor(batch_num_tokens, dtype=m.dtype)
        return torch.where(tokens > 0, m * dp_size / tokens.clamp(min=1e-30), 0.0)  # no token: weight 0, not NaN
    if mode == "token-sum":
        return m * dp_size
    per_row = m.sum(-1, keepdim=True)
    rows = (per_row > 0).float()
    sequences = rows.sum() if global_batch_size is None else torch.as_tensor(global_batch_size, dtype=m.dtype)
    row_weight = torch.where(sequences > 0, rows * dp_size / sequences.clamp(min=1e-30), 0.0)
    if mode == "seq-mean-token-mean":
        return m * row_weight / (per_row + 1e-8)  # verl's token-mean per sequence, with its epsilon
    if mode == "seq-mean-token-sum":
        return m * row_weight
    if mode == "seq-mean-token-sum-norm":
        return m * row_weight / (L if loss_scale_factor is None else loss_scale_factor)
    raise ValueError(f"loss_agg_mode must be one of {list(AGGREGATION_MODES)}, got {mode!r}")


def compute_policy_loss_sage(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
):
    """verl's policy-loss signature: the SAGE PG term, aggregated with `loss_agg_mode`.

    Reads ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c`` (dual clip)
    and ``global_batch_info`` from `config` (verl's ActorConfig or a dict-like). Returns
    ``(loss, metrics)`` with verl's metric names: ``actor/pg_clipfrac``, ``actor/ppo_kl``,
    ``actor/pg_clipfrac_lower``. `cu_seqlens`: the per-token tensors are S packed sequences
    (`packed_policy_inputs`).
    """
    if config is None:
        raise ValueError("config (verl's ActorConfig) is required for the clip ranges")
    if cu_seqlens is not None:
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights = packed_policy_inputs(
            cu_seqlens, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights
        )
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    clip = _config_value(config, "clip_ratio", 0.2)
    eps_low = _config_value(config, "clip_ratio_low", clip)
    eps_high = _config_value(config, "clip_ratio_high", clip)
    dual_clip_c = _config_value(config, "clip_ratio_c", 3.0)
    mask = response_mask.bool()
    batch_info = dict(_config_value(config, "global_batch_info", {}))
    weights = _aggregation_weights(mask, loss_agg_mode, **batch_info)
    if rollout_is_weights is not None:
        weights = weights * rollout_is_weights.float()
    loss_config = LossConfig(
        beta=0.0, guide="none", loss_type="dapo", eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c
    )
    loss, ratio, A = _weighted_pg(old_log_prob, log_prob, advantages, mask, weights, loss_config)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    pg = torch.maximum(-A * ratio, -A * clipped)
    metrics = {
        "actor/pg_clipfrac": _masked_mean((-A * clipped > -A * ratio).float(), mask),
        "actor/ppo_kl": _ppo_kl(old_log_prob, log_prob, mask),
        "actor/pg_clipfrac_lower": _masked_mean(((pg > -A * dual_clip_c) & (A < 0)).float(), mask),
    }
    return loss, metrics


def compute_policy_loss_sage_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
):
    """verl's policy-loss signature: the sapo PG term (docs/loss.md) as verl's ``"sapo"`` aggregates it.

    Reads ``tau_pos``, ``tau_neg`` (verl's names for the gate temperatures, defaults 1.0 and 1.05)
    and ``global_batch_info`` from `config`. Like verl's sapo, the aggregation is always
    seq-mean-token-mean (`loss_agg_mode` is taken for the signature only) and the clip fractions are 0.
    `cu_seqlens`: packed sequences, as in `compute_policy_loss_sage`.
    """
    if config is None:
        raise ValueError("config (verl's ActorConfig) is required for the gate temperatures")
    if cu_seqlens is not None:
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights = packed_policy_inputs(
            cu_seqlens, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights
        )
    del loss_agg_mode
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    mask = response_mask.bool()
    batch_info = dict(_config_value(config, "global_batch_info", {}))
    weights = _aggregation_weights(mask, "seq-mean-token-mean", **batch_info)
    if rollout_is_weights is not None:
        weights = weights * rollout_is_weights.float()
    loss_config = LossConfig(
        beta=0.0,
        guide="none",
        loss_type="sapo",
        sapo_temperature_pos=float(_config_value(config, "tau_pos", 1.0)),
        sapo_temperature_neg=float(_config_value(config, "tau_neg", 1.05)),
    )
    loss, _, _ = _weighted_pg(old_log_prob, log_prob, advantages, mask, weights, loss_config)
    return loss, {
        "actor/pg_clipfrac": 0.0,
        "actor/ppo_kl": _ppo_kl(old_log_prob, log_prob, mask),
        "actor/pg_clipfrac_lower": 0.0,
    }


def _dppo_loss(loss_type, old_log_prob, log_prob, advantages, response_mask, weights_in, loss_agg_mode, config):
    """verl's dppo_tv / dppo_kl with docs/loss.md's PG term: (loss, verl's metrics)."""
    if config is None:
        raise ValueError("config (verl's ActorConfig) is required for the trust-region thresholds")
    check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, weights_in)
    clip = _config_value(config, "clip_ratio", 0.2)
    cap = float(_config_value(config, "clip_ratio_c", 20.0))
    loss_config = LossConfig(
        beta=0.0,
        guide="none",
        loss_type=loss_type,
        eps_low=_config_value(config, "clip_ratio_low", clip),
        eps_high=_config_value(config, "clip_ratio_high", clip),
        dppo_ratio_cap=cap,
    )
    mask = response_mask.bool()
    weights = _aggregation_weights(mask, loss_agg_mode, **dict(_config_value(config, "global_batch_info", {})))
    if weights_in is not None:
        weights = weights * weights_in.float()
    loss, ratio, A = _weighted_pg(old_log_prob, log_prob, advantages, mask, weights, loss_config)
    old = torch.where(mask, old_log_prob.detach().float(), 0.0)
    inside = dppo_trust_region(torch.where(mask, log_prob.detach().float(), 0.0), old, A, loss_config)
    return loss, {
        "actor/pg_clipfrac": _masked_mean((~inside).float(), mask),
        "actor/ppo_kl": _ppo_kl(old_log_prob, log_prob, mask),
        "actor/pg_clipfrac_lower": _masked_mean(((ratio > cap) & inside).float(), mask),
    }


def compute_policy_loss_sage_dppo_tv(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
    *,
    cu_seqlens=None,
):
    """verl's policy-loss signature: DPPO-Binary-TV (docs/loss.md's dppo_tv), verl's metrics; its
    ``pg_clipfrac`` is the fraction of tokens outside the trust region, ``pg_clipfrac_lower`` that of
    kept tokens whose ratio is truncated at ``clip_ratio_c``. `cu_seqlens`: packed sequences, as in
    `compute_policy_loss_sage`."""
    args = (old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    if cu_seqlens is not None:
        args = packed_policy_inputs(cu_seqlens, *args)
    return _dppo_loss("dppo_tv", *args, loss_agg_mode, config)


def compute_policy_loss_sage_dppo_kl(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
    *,
    cu_seqlens=None,
):
    """verl's policy-loss signature: DPPO-Binary-KL (docs/loss.md's dppo_kl), verl's metrics; `cu_seqlens` as
    in `compute_policy_loss_sage`."""
    args = (old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    if cu_seqlens is not None:
        args = packed_policy_inputs(cu_seqlens, *args)
    return _dppo_loss("dppo_kl", *args, loss_agg_mode, config)


def compute_rollout_corr_metrics(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold=2.0,
) -> dict[str, float]:
    """verl's ``rollout_corr/*`` metrics as floats, under its names, for `log_prob` (the trainer's) against
    `rollout_log_prob` (the engine's), [B, L] each: every name of its ``compute_offpolicy_metrics`` and,
    with `rollout_is` ("token" or "sequence") and `rollout_is_threshold` (u or ``"lower_upper"``), of its
    ``compute_is_metrics`` (`sage_kernels.rollout_corr`)."""
    _check_per_token(log_prob, response_mask, rollout_log_prob=rollout_log_prob)
    upper, lower = rollout_corr.parse_is_threshold(rollout_is_threshold) if rollout_is is not None else (2.0, None)
    metrics = rollout_corr.rollout_corr_metrics(
        log_prob, rollout_log_prob, response_mask.bool(), level=rollout_is, upper=upper, lower=lower
    )
    return {name: value.item() for name, value in metrics.items()}


def compute_policy_loss_sage_bypass(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
):
    """verl's ``"bypass_mode"`` policy loss with the SAGE PG term, registered as ``"sage_bypass"``.

    Bypass mode: `old_log_prob` holds the rollout engine's log-probs (verl's ``apply_bypass_mode`` puts
    ``rollout_log_probs`` there), so the PPO ratio pi_theta / pi_rollout is itself the importance
    correction: the loss is `compute_policy_loss_sage` with no further weights (`rollout_is_weights`
    is ignored, as verl ignores it), and the metrics add verl's ``rollout_corr/*`` of the current
    log-probs against the rollout ones (`compute_rollout_corr_metrics`), its ``rollout_is_*`` at
    ``rollout_is`` / ``rollout_is_threshold``. Reads ``config.policy_loss.rollout_correction`` as verl
    does; its ``loss_type`` must be ``"ppo_clip"`` (verl's ``"reinforce"`` has no SAGE counterpart) and
    ``rollout_rs`` / ``rollout_is_batch_normalize`` must be off: each is refused naming the key."""
    del rollout_is_weights
    if config is None:
        raise ValueError("config (verl's ActorConfig) is required: its policy_loss.rollout_correction")
    policy_loss = _config_value(config, "policy_loss", {})
    correction = _config_value(policy_loss, "rollout_correction", None)
    if correction is None:
        raise ValueError("config.policy_loss.rollout_correction is required by sage_bypass (verl's bypass mode)")
    loss_type = _config_value(correction, "loss_type", "ppo_clip")
    if loss_type != "ppo_clip":
        raise ValueError(f"rollout_correction.loss_type must be 'ppo_clip' with sage_bypass, got {loss_type!r}")
    for key in ("rollout_rs", "rollout_is_batch_normalize"):
        if _config_value(correction, key, None):
            value = _config_value(correction, key, None)
            raise ValueError(f"rollout_correction.{key} must be off with sage_bypass, got {value!r}")
    if cu_seqlens is not None:
        old_log_prob, log_prob, advantages, response_mask, _ = packed_policy_inputs(
            cu_seqlens, old_log_prob, log_prob, advantages, response_mask, None
        )
    loss, metrics = compute_policy_loss_sage(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)
    level = _config_value(correction, "rollout_is", None)
    threshold = _config_value(correction, "rollout_is_threshold", 2.0)
    metrics.update(compute_rollout_corr_metrics(log_prob.detach(), old_log_prob, response_mask, level, threshold))
    return loss, metrics


def packed_policy_inputs(cu_seqlens, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights):
    """The policy losses' per-token tensors, given as S packed sequences of N tokens ([N] or [1, N]
    each, as verl's remove-padding stream holds them: ``log_probs.values()`` of its nested output,
    ``offsets()`` for `cu_seqlens`), on the [S, L] grid of those sequences (`packing.TokenLayout`,
    L the longest), where every aggregation mode reads them as it reads verl's padded rows;
    ``seq-mean-token-sum-norm`` divides by that L unless ``global_batch_info`` gives
    ``loss_scale_factor``. The gradient flows back to the packed `log_prob`."""
    if not isinstance(log_prob, torch.Tensor):
        raise TypeError(f"log_prob must be a torch.Tensor, got {type(log_prob).__name__}")
    layout = packed_layout(cu_seqlens, log_prob.numel(), log_prob.device)
    named = dict(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
    )
    return tuple(on_grid(layout, name, value, log_prob.device) for name, value in named.items())


def check_policy_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights=None) -> None:
    """The policy losses' documented inputs, each of log_prob's shape [B, L] (verl's padded
    response tensors: one value per response token, advantages per token too): otherwise one
    ValueError naming the argument, its shape and the expected one, before any broadcast can
    read a [B] or [1, L] tensor across rows or columns. Log-probs and weights must be finite where
    `response_mask` is set."""
    named = dict(old_log_prob=old_log_prob, advantages=advantages, rollout_is_weights=rollout_is_weights)
    _check_per_token(log_prob, response_mask, **named)
    named["log_prob"] = log_prob
    for name, value in named.items():
        if value is not None:
            check_finite(name, value.detach().float(), where=response_mask.bool())


def _check_per_token(log_prob, response_mask, **named) -> None:
    """log_prob [B, L] and every tensor of `named` (None: absent) and `response_mask` of its shape."""
    check_tensor("log_prob", log_prob, ndim=(2,), float_=True)
    expected = tuple(log_prob.shape)
    for name, value in {**named, "response_mask": response_mask}.items():
        if value is None:
            continue
        check_tensor(name, value, device=log_prob.device)
        if tuple(value.shape) != expected:
            raise ValueError(
                f"{name} must have log_prob's shape [B, L] = {list(expected)} (one value per response token), "
                f"got {list(value.shape)}"
            )


def _weighted_pg(old_log_prob, log_prob, advantages, mask, weights, config: LossConfig):
    """(sum of weights * the PG term of `config.loss_type`, the ratio, the masked advantages)."""
    A = torch.where(mask, advantages.detach().float(), 0.0)
    inputs = SageInputs(
        hidden=None,
        weight=None,
        bias=None,
        token_ids=torch.zeros_like(mask, dtype=torch.long),
        mask=mask,
        advantages=A,
        old_logp=torch.where(mask, old_log_prob.detach().float(), 0.0),
        ref_logp=None,
        is_weights=None,
        log_q=None,
    )
    logp = torch.where(mask, log_prob.float(), 0.0)
    token_log_ratio = logp - inputs.old_logp
    ratio = torch.exp(token_log_ratio)
    pg, _, _ = policy_gradient_term(logp, ratio, token_log_ratio, A, inputs, config)
    return (torch.where(mask, weights, 0.0) * pg).sum(), ratio.detach(), A


def _ppo_kl(old_log_prob, log_prob, mask) -> float:
    return _masked_mean(torch.where(mask, old_log_prob.detach().float() - log_prob.detach().float(), 0.0), mask)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).item()


def _register() -> bool:
    """Add ``"sage"`` to verl's policy-loss registry when verl imports; True when registered."""
    try:
        from verl.trainer.ppo.core_algos import register_policy_loss
    except ImportError:
        return False
    register_policy_loss("sage")(compute_policy_loss_sage)
    register_policy_loss("sage_sapo")(compute_policy_loss_sage_sapo)
    register_policy_loss("sage_dppo_tv")(compute_policy_loss_sage_dppo_tv)
    register_policy_loss("sage_dppo_kl")(compute_policy_loss_sage_dppo_kl)
    register_policy_loss("sage_bypass")(compute_policy_loss_sage_bypass)
    return True


VERL_REGISTERED = _register()
