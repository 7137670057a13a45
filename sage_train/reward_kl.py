"""SAGE's objective through the reward (config key ``kl_in_reward``, presets ``*-exact``).

The objective SAGE is argued from is J(pi) = E_pi[r] - beta * KL(pi || Q), Q(x) = pi_ref(x) *
prod_t q_t (docs/convergence.md). No per-token loss estimator differentiates it for a guide
that depends on the position only, but the reward can carry it, as verl's ``use_kl_in_reward``
carries the plain KL: at generation, per completion token,

    c_t = log pi_old(y_t) - log pi_ref(y_t) - log q_t          (the k1 form)

summed over the completion (``kl_in_reward_length_normalized``: averaged over its tokens) and
subtracted, times beta, from the verifier's reward before the group advantages; the loss's
own beta is then 0. On-policy the sum is log pi(x) - log Q(x), so the policy gradient of the
shaped reward is the gradient of J with Q held fixed, and training settles at pi* proportional
to Q exp(r / beta) (with q recomputed from the behaviour policy: at the self-consistent point).

Why k1 and not k3: per prefix, E_pi[k3] = KL(pi || pi_ref) + (q - 1 - log q) for a position-only
q, and q - 1 - log q >= 0, so k3 in the reward would penalise every q != 1, where J gives the
bonus +beta log q. The length risk: that bonus is collected per token, so a completion gains
beta * sum_t log q_t, more the longer it runs through uncertain prefixes; averaging over the
completion's tokens bounds it by beta * log q_max whatever the length (and changes the
objective to E[r] - beta * E[KL(x) / |x|] when lengths differ).

q is the guide's, from the behaviour policy at generation: the branch guide from its entropy,
the token guide from its surprisal, the random guide's draw, each with its own options and
schedule (`sage_kernels.guides`).
"""

from __future__ import annotations

import torch

from sage_kernels.guides import Guide
from sage_kernels.ordered import ordered_sum


def generation_log_q(guide: Guide | None, old_logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor):
    """log q [B, L] of the behaviour policy's completions (0 where masked), or None without a guide:
    the guide given the behaviour policy's log-probs and entropies."""
    return None if guide is None else guide.log_q(old_logp, entropy, mask)


def sequence_kl(
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    log_q: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    length_normalized: bool = False,
) -> torch.Tensor:
    """[B]: sum over each completion's tokens of c_t = old_logp - ref_logp - log_q (log_q None: 0),
    or its mean over the completion's tokens (0 for a row without any). No gradient."""
    c = old_logp.detach().double() - ref_logp.detach().double()
    if log_q is not None:
        c = c - log_q.detach().double()
    total = ordered_sum(torch.where(mask, c, 0.0), -1)
    if length_normalized:
        total = total / mask.sum(-1).clamp(min=1)
    return total


def shaped_rewards(cfg, guide, rewards, old_logp, entropy, ref_logp, mask) -> tuple[torch.Tensor, dict]:
    """(rewards [G, n] minus beta times each completion's `sequence_kl`, metrics): what the group
    advantages are computed from under ``kl_in_reward``. Rows are the completions in group order."""
    log_q = generation_log_q(guide, old_logp, entropy, mask)
    kl = sequence_kl(old_logp, ref_logp, log_q, mask, length_normalized=cfg.kl_in_reward_length_normalized)
    penalty = (cfg.beta * kl).to(torch.float32).view(rewards.shape)
    tokens = mask.sum().clamp(min=1)
    q = torch.ones_like(old_logp) if log_q is None else log_q.exp()
    metrics = {
        "kl_in_reward/kl": kl.mean(),  # per completion (per token with length normalisation)
        "kl_in_reward/penalty": penalty.mean(),  # what the reward lost to it, on average
        "kl_in_reward/q_mean": torch.where(mask, q, 0.0).sum() / tokens,
        "kl_in_reward/frac_q_gt_1": ((q > 1.0) & mask).sum() / tokens,
    }
    return rewards.to(penalty.device) - penalty, metrics
