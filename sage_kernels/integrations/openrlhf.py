"""OpenRLHF adapters: SAGE's anchor in its KL, the fused LM head in its actor, and a policy loss.

OpenRLHF (0.11) computes the KL between the actor and the reference model in two places, both from
``base_action_log_probs`` with ``compute_approx_kl``: in the reward (its default: the experience
maker subtracts ``kl_coef * KL`` per token, k1 by default, which is SAGE's objective with q = 1) or,
with ``--algo.kl.use_loss``, in the actor's loss. Replacing ``base_action_log_probs`` by the SAGE
anchor log(q * pi_ref) (`sage_anchor_log_probs`) moves both onto KL(pi || q pi_ref), with q from the
behaviour policy's entropy, fixed for the update, as in the verl adapter.

- `sage_anchor_log_probs(base_action_log_probs, entropy, action_mask)`: the anchor per response token.
- `compute_approx_kl`: OpenRLHF's estimator with its signature and semantics (k1/k2/k3, the [-10, 10]
  value clamp, k3's log-ratio floor at -10, ``unbiased_gradient``'s straight-through k2 gradient
  with the importance weight clamped at 10); given the anchor as ``log_probs_base`` it is the SAGE KL.
- `fused_action_log_probs` / `patch_actor_forward`: the actor's forward without the [B, T, V] fp32
  logits: the decoder's hidden states at the response positions go through the fused log-prob and
  entropy sweep (`sage_kernels.integrations.verl.linear_cross_entropy`, differentiable), so the
  behaviour pass yields the entropy the guide needs at no extra cost. With the actor's
  ``packing_samples`` the decoder runs, as OpenRLHF's does, on the batch's unpadded tokens packed into
  one [1, total] row whose positions restart per sequence (flash-attn's varlen kernels on GPU;
  transformers' block-diagonal mask from the positions for sdpa/eager), and only the response rows
  of that stream are swept; ring attention is refused. Models whose config scales or softcaps the
  logits are refused (OpenRLHF's head does not apply them either).
- `SAGEPolicyLoss`: OpenRLHF's ``PolicyLoss`` constructor and forward (returning ``(loss, clip_ratio,
  ppo_kl, vllm_kl, is_filter_ratio)``) with this package's loss types (``loss_type``: grpo/ppo's
  clipped surrogate, dppo_tv, cispo, sapo, ... with their `LossConfig` options), OpenRLHF's two
  aggregations, ``policy_loss_type`` ppo or gspo, and its train/rollout correction (token or
  sequence; mask or clip; gated by the ratio, the binary KL or the total variation). With
  ``loss_type="grpo"`` it equals OpenRLHF's ``PolicyLoss`` except that the ppo log-ratio is not
  clamped to [-20, 20]; unlike it, every tensor's shape is checked and a batch with no token kept
  gives loss 0, not NaN.

`sage_kernels.integrations.openrlhf_launch` runs an OpenRLHF entry point with `SAGEPolicyLoss` in
place of ``PolicyLoss``, in the driver and in every Ray worker, with no OpenRLHF file edited.
"""

from __future__ import annotations

import torch
from torch import nn

from ..guides import branch_guide
from ..inputs import SageInputs, check_finite
from ..reference import kl_estimate, policy_gradient_term
from ..spec import LossConfig
from .hf_logits import logit_options
from .verl import linear_cross_entropy

_DEFAULTS = LossConfig()
#: OpenRLHF's bounds: the estimator's value, k3's log-ratio floor, the unbiased gradient's weight
KL_VALUE_CLAMP, K3_LOG_RATIO_FLOOR, KL_IS_WEIGHT_CLIP = 10.0, -10.0, 10.0


def branch_log_q(
    entropy, action_mask, *, gamma=_DEFAULTS.gamma, tau=_DEFAULTS.tau, q_min=_DEFAULTS.q_min, q_max=_DEFAULTS.q_max
):
    """log q of the branch guide per token (0 at masked positions), at least float32, no gradient."""
    entropy = entropy.detach().to(torch.promote_types(entropy.dtype, torch.float32))
    q = branch_guide(entropy, gamma=gamma, tau=tau, q_min=q_min, q_max=q_max)
    return torch.where(action_mask.bool(), q.log(), 0.0)


def sage_anchor_log_probs(base_action_log_probs, entropy, action_mask, **guide) -> torch.Tensor:
    """log(q * pi_ref) = base_action_log_probs + log q, q the branch guide of the behaviour policy's
    `entropy` (`guide`: gamma, tau, q_min, q_max; `LossConfig`'s defaults). Put it in place of the
    experience's ``base_action_log_probs``."""
    base = base_action_log_probs.detach()
    base = base.to(torch.promote_types(base.dtype, torch.float32))
    return base + branch_log_q(entropy, action_mask, **guide).to(base.dtype)


def compute_approx_kl(log_probs, log_probs_base, log_probs_old=None, kl_estimator="k1", unbiased_gradient=False):
    """OpenRLHF's ``compute_approx_kl`` (module docstring): the `kl_estimator` of
    delta = log_probs_base - log_probs (k1 = -delta, k2 = delta^2 / 2, k3 = e^delta - 1 - delta, delta
    at most 10 for k3), clamped to [-10, 10]; with `unbiased_gradient`, that value forward and the
    gradient of w k2 (w = min(pi / pi_old, 10), detached; 1 without `log_probs_old`)."""
    if kl_estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"kl_estimator must be 'k1', 'k2' or 'k3', got {kl_estimator!r}")
    delta = log_probs_base.float() - log_probs.float()
    estimated = delta.clamp(max=-K3_LOG_RATIO_FLOOR) if kl_estimator == "k3" else delta
    value = kl_estimate(estimated, kl_estimator).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)
    if not unbiased_gradient:
        return value
    weight = 1.0
    if log_probs_old is not None:
        weight = (log_probs.float() - log_probs_old.float()).exp().clamp(max=KL_IS_WEIGHT_CLIP).detach()
    surrogate = weight * kl_estimate(delta, "k2")
    return value.detach() + surrogate - surrogate.detach()


def fused_action_log_probs(actor, sequences, action_mask, attention_mask, *, with_entropy=False):
    """(action log-probs [B, n] times `action_mask`, entropies [B, n] or None) of OpenRLHF's `actor`
    (its ``.model`` a causal LM, possibly PEFT-wrapped; ``.temperature``; ``.packing_samples``) on
    right-aligned responses of n = action_mask.shape[1] tokens, without the logits; both differentiable."""
    lm = actor.model.get_base_model() if hasattr(actor.model, "get_base_model") else actor.model
    options = logit_options(lm.config)
    if options != {"logit_scale": 1.0, "logit_softcap": None}:
        raise ValueError(f"actor's model scales or softcaps its logits ({options}); the fused forward does not")
    head = lm.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("actor's LM head has a bias; the fused forward takes a bias-free head")
    temperature = float(getattr(actor, "temperature", 1.0))
    B, T = sequences.shape
    n = action_mask.shape[1]
    # position t's hidden state predicts token t + 1: the response tokens T-n..T-1 are read at T-n-1..T-2
    targets = torch.roll(sequences, shifts=-1, dims=1)[:, -n - 1 : -1]
    if not getattr(actor, "packing_samples", False):
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        decoder = lm.get_decoder()
        hidden = decoder(
            input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )[0]
        logp, entropy = linear_cross_entropy(hidden[:, -n - 1 : -1], head.weight, targets, temperature=temperature)
        return logp * action_mask.float(), (entropy if with_entropy else None)
    # packing_samples: the kept tokens of every row back to back, positions restarting per sequence; without
    # a cache, transformers derives the block-diagonal mask from those positions (a cache turns that off)
    kept = attention_mask.bool().reshape(-1).nonzero().squeeze(1)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0).reshape(-1)[kept]
    hidden = lm.get_decoder()(
        input_ids=sequences.reshape(-1)[kept][None],
        attention_mask=None,
        position_ids=position_ids[None],
        use_cache=False,
    )[0][0]
    # the packed rows at the response positions (the others are never swept), and where they go
    columns = kept % T
    read = ((columns >= T - n - 1) & (columns < T - 1)).nonzero().squeeze(1)
    rows, cols = kept[read] // T, columns[read] - (T - n - 1)
    logp, entropy = linear_cross_entropy(hidden[read], head.weight, targets[rows, cols], temperature=temperature)
    placed = [t.new_zeros(B, n).index_put((rows, cols), t) for t in (logp, entropy)]
    return placed[0] * action_mask.float(), (placed[1] if with_entropy else None)


def patch_actor_forward(actor) -> None:
    """Replace `actor.forward` (an OpenRLHF ``Actor``) by one that returns what OpenRLHF's returns for
    action log-probs, ``(action_log_probs, output)`` with ``return_output`` (``output.entropy`` [B, T-1]
    filled at the response positions with ``return_entropy``; no ``logits``), built by
    `fused_action_log_probs`. Calls without `action_mask` (logits wanted) raise."""

    def forward(sequences, action_mask=None, attention_mask=None, return_output=False, return_entropy=False, **kw):
        if action_mask is None or kw.get("allgather_logits") or kw.get("return_logprobs"):
            raise ValueError("the fused actor forward returns action log-probs only: pass action_mask")
        if kw.get("ring_attn_group") is not None:
            raise NotImplementedError("ring attention (ring_attn_group) is not supported by the fused forward")
        logp, entropy = fused_action_log_probs(
            actor, sequences, action_mask, attention_mask, with_entropy=return_entropy
        )
        if not return_output:
            return logp
        output = _Output()
        if return_entropy:
            full = entropy.new_zeros(sequences.shape[0], sequences.shape[1] - 1)
            full[:, -action_mask.shape[1] :] = entropy
            output.entropy = full
        return logp, output

    actor.forward = forward


class _Output(dict):
    """The model output OpenRLHF's trainer reads (``output.entropy``, ``output.aux_loss``)."""

    aux_loss = None


#: OpenRLHF's train/rollout correction: the levels, modes and gated statistics it takes
IS_CORRECTION_LEVELS = ("off", "token", "seq")
IS_CORRECTION_MODES = ("mask", "clip")
IS_CORRECTION_GATINGS = ("ratio", "binary_kl", "tv")
#: OpenRLHF's clamp on the sampled-token probabilities the divergence gates read (binary KL's logs stay finite)
GATE_PROB_CLAMP = 1e-6


class SAGEPolicyLoss(nn.Module):
    """OpenRLHF's ``PolicyLoss`` with this package's loss types (module docstring). `loss_type` and
    `loss_options` are `LossConfig`'s; the clip range, dual clip, ``policy_loss_type`` (ppo, gspo) and
    the train/rollout correction (level off/token/seq, mode mask/clip, gating ratio/binary_kl/tv) are
    OpenRLHF's arguments, refused with OpenRLHF's rules.

    Inputs (B rows, L response tokens): `log_probs` [B, L] floating point; `old_log_probs` [B, L];
    `advantages` [B, L] or [B, 1] (one per row); `action_mask` [B, L] or None (all tokens);
    `rollout_log_probs` [B, L], required when ``is_correction_level`` is not "off". Any other shape
    is refused with a ValueError naming the argument. `old_log_probs`, `advantages` and
    `rollout_log_probs` must be finite wherever `action_mask` keeps a token (a ValueError naming the
    argument on CPU, an asynchronous device assertion on CUDA); elsewhere they are not read.
    Returns ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)`` as OpenRLHF does (the last two
    None without the correction). With no token kept (`action_mask` all zero) the loss is 0 with zero
    gradients and every metric is 0 (OpenRLHF's divides 0 by 0: NaN); ``batch_num_tokens`` and
    ``global_batch_size`` of 0 count as 1 for the same reason."""

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float | None = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold=(0.5, 5.0),
        *,
        loss_type: str = "grpo",
        **loss_options,
    ) -> None:
        super().__init__()
        if policy_loss_type not in ("ppo", "gspo"):
            raise ValueError(f"policy_loss_type must be 'ppo' or 'gspo', got {policy_loss_type!r}")
        for name, value, allowed in (
            ("is_correction_level", is_correction_level, IS_CORRECTION_LEVELS),
            ("is_correction_mode", is_correction_mode, IS_CORRECTION_MODES),
            ("is_correction_gating", is_correction_gating, IS_CORRECTION_GATINGS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if is_correction_mode == "clip" and (is_correction_level == "seq" or is_correction_gating != "ratio"):
            raise ValueError(
                "is_correction_mode 'clip' needs is_correction_level 'token' and is_correction_gating 'ratio' "
                "(only the token ratio is a weight; the others are rejection filters)"
            )
        threshold = tuple(is_correction_threshold)
        if len(threshold) != 2 or threshold[0] > threshold[1]:
            raise ValueError(f"is_correction_threshold must be (low, high) with low <= high, got {threshold!r}")
        if is_correction_gating != "ratio" and is_correction_level != "off" and threshold[0] > 0:
            raise ValueError(
                f"is_correction_threshold's low bound must be <= 0 with is_correction_gating {is_correction_gating!r} "
                f"(a divergence has an upper bound only), got {threshold!r}"
            )
        if policy_loss_type == "gspo" and (
            loss_type != "grpo" or loss_options.get("importance_sampling", "token") != "token"
        ):
            raise ValueError(
                "policy_loss_type 'gspo' takes loss_type 'grpo' (its clipped surrogate) with importance_sampling "
                f"'token' (the ratio is the row's), got {loss_type!r}, {loss_options.get('importance_sampling')!r}"
            )
        self.config = LossConfig(
            beta=0.0,
            guide="none",
            loss_type=loss_type,
            eps_low=clip_eps_low,
            eps_high=clip_eps_high,
            dual_clip_c=dual_clip,
            **loss_options,
        )
        self.policy_loss_type = policy_loss_type
        # GSPO's loss is a per-sequence mean, as in OpenRLHF
        self.token_level_loss = token_level_loss and policy_loss_type != "gspo"
        self.is_correction = (is_correction_level, is_correction_mode, is_correction_gating, threshold)

    def forward(
        self,
        log_probs,
        old_log_probs,
        advantages,
        action_mask=None,
        rollout_log_probs=None,
        dp_size=1,
        batch_num_tokens=None,
        global_batch_size=None,
    ):
        level, mode, gating, (lower, upper) = self.is_correction
        mask = _checked_mask(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, level)
        m = mask.float()
        # the experience's tensors, where a token is kept (a NaN there would reach the loss silently)
        check_finite("old_log_probs", old_log_probs.detach(), mask)
        check_finite("advantages", advantages.detach().expand_as(mask), mask)
        A = torch.where(mask, advantages.detach().float().expand_as(mask), 0.0)
        old = torch.where(mask, old_log_probs.detach().float(), 0.0)
        logp = torch.where(mask, log_probs.float(), 0.0)
        rollout = None
        if level != "off":
            check_finite("rollout_log_probs", rollout_log_probs, mask)
            rollout = torch.where(mask, rollout_log_probs.detach().float(), 0.0)
        inputs = SageInputs(None, None, None, torch.zeros_like(mask, dtype=torch.long), mask, A, old, None, None, None)
        token_log_ratio = logp - old
        if self.policy_loss_type == "gspo":
            # OpenRLHF's GSPO: the row's mean log-ratio, against the rollout's log-probs under the correction
            base = old if rollout is None else rollout
            ratio = _row_mean(logp - base, m).exp().expand_as(m)
        elif self.config.importance_sampling == "sequence":
            ratio = _row_mean(token_log_ratio, m).exp().expand_as(m)
        else:
            ratio = token_log_ratio.exp()
        pg, low, high = policy_gradient_term(logp, ratio, token_log_ratio, A, inputs, self.config)
        vllm_kl = is_filter_ratio = None
        if rollout is not None and self.policy_loss_type == "ppo":
            is_log_ratio = old - rollout
            if gating == "ratio":
                stat = (is_log_ratio if level == "token" else _row_mean(is_log_ratio, m)).exp()
            else:
                p = rollout.exp().clamp(GATE_PROB_CLAMP, 1 - GATE_PROB_CLAMP)
                q = old.exp().clamp(GATE_PROB_CLAMP, 1 - GATE_PROB_CLAMP)
                stat = (
                    p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log() if gating == "binary_kl" else (p - q).abs()
                )
                stat = stat if level == "token" else _row_mean(stat, m)
            if mode == "clip":
                coef, filtered = stat.clamp(lower, upper), (stat < lower) | (stat > upper)
            else:
                keep = (stat >= lower) & (stat <= upper)
                coef, filtered = torch.where(keep, is_log_ratio.exp(), 0.0), ~keep
            pg = coef * pg
            # at the sequence level a row with no token kept has statistic 0 (ratio 1) where OpenRLHF's is 0/0
            is_filter_ratio = filtered.float().mean() if level == "seq" else _masked_mean(filtered.float(), m)
            vllm_kl = _masked_mean(rollout - old, m)
        loss = _aggregate(pg, m, self.token_level_loss, dp_size, batch_num_tokens, global_batch_size)
        return (
            loss,
            _masked_mean((low | high).float(), m),
            _masked_mean(-token_log_ratio.detach(), m),
            vllm_kl,
            is_filter_ratio,
        )


def _shape(t) -> str:
    return "[" + ", ".join(map(str, t.shape)) + "]"


def _checked_mask(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, level) -> torch.Tensor:
    """`action_mask` as bool [B, L] after checking every argument's shape against `log_probs` [B, L];
    a ValueError naming the first argument that does not fit."""
    if not isinstance(log_probs, torch.Tensor) or log_probs.dim() != 2 or not log_probs.is_floating_point():
        got = (
            _shape(log_probs) + f" {log_probs.dtype}"
            if isinstance(log_probs, torch.Tensor)
            else type(log_probs).__name__
        )
        raise ValueError(f"log_probs must be a floating-point tensor of shape [B, L], got {got}")
    B, L = log_probs.shape
    expected = {"old_log_probs": [(B, L)], "advantages": [(B, L), (B, 1)], "action_mask": [(B, L)]}
    if level != "off":
        if rollout_log_probs is None:
            raise ValueError(
                "rollout_log_probs (the rollout engine's log-probs, [B, L]) is required with "
                f"is_correction_level {level!r}"
            )
        expected["rollout_log_probs"] = [(B, L)]
    given = {
        "old_log_probs": old_log_probs,
        "advantages": advantages,
        "action_mask": action_mask,
        "rollout_log_probs": rollout_log_probs,
    }
    for name, shapes in expected.items():
        value = given[name]
        if value is None and name == "action_mask":
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape) not in shapes:
            got = _shape(value) if isinstance(value, torch.Tensor) else type(value).__name__
            want = " or ".join("[" + ", ".join(map(str, s)) + "]" for s in shapes)
            raise ValueError(f"{name} must have shape {want} (log_probs is [B, L] = [{B}, {L}]), got {got}")
    return torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask.bool()


def _row_mean(x, m):
    """Each row's mean of `x` over its kept tokens, [B, 1] (0 for a row with none)."""
    return (x * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)


def _masked_mean(x, m):
    """The mean of `x` over the kept tokens; 0 when none is kept."""
    return (x * m).sum() / m.sum().clamp(min=1)


def _aggregate(loss, m, token_level, dp_size, batch_num_tokens, global_batch_size):
    """OpenRLHF's ``aggregate_loss``: the token mean (over `batch_num_tokens` when given), or the mean
    over the non-empty rows (over `global_batch_size` when given) of each row's token mean."""
    if token_level:
        if batch_num_tokens is None:
            return _masked_mean(loss, m)
        return (loss * m).sum() / _at_least_one(batch_num_tokens, m) * dp_size
    counts = m.sum(-1)
    rows = (loss * m).sum(-1) / (counts + 1e-8)
    present = (counts > 0).float()
    if global_batch_size is None:
        return (rows * present).sum() / present.sum().clamp(min=1)
    return (rows * present).sum() / _at_least_one(global_batch_size, m) * dp_size


def _at_least_one(count, like):
    """A token or row count (a number or a tensor), 1 where it is 0: the sum it divides is 0 then."""
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)
