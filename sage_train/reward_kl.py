"""SAGE's objective through the advantage (config key ``kl_in_reward``, presets ``*-exact``).

The objective SAGE is argued from is J(pi) = E_pi[r] - beta * KL(pi || Q), Q(x) = pi_ref(x) *
prod_t q_t (docs/convergence.md). No per-token loss estimator differentiates it for a guide
that depends on the position only, but the advantage can carry it, as verl's
``use_kl_in_reward`` carries the plain KL: at generation, per completion token,

    c_t = log pi_old(y_t) - log pi_ref(y_t) - log q_t          (the k1 form)

summed over the completion (``kl_in_reward_length_normalized``: averaged over its tokens) into
c, and each completion's advantage is

    A_i = task_i - beta * (c_i - mean_j c_j)          (j over the completions of its prompt)

with task_i the verifier reward's own group advantage (`group_advantages`, scaled by its std
under ``scale_rewards`` as for any GRPO run); the loss's own beta is 0. On-policy c = log pi(x) -
log Q(x), and E_pi[c grad log pi] = grad KL(pi || Q) with Q held fixed, while a group-mean
baseline multiplies a term's expected gradient by (n - 1) / n (n completions per prompt). So the
KL part's expected gradient is exactly (n - 1)/n * (-beta grad KL(pi || Q)), in every group,
including groups whose task rewards are all equal (task_i = 0 there; the KL part is not);
with ``scale_rewards: false`` the whole advantage's is (n - 1)/n * grad J (tested on the
enumerable toy, tests/train/test_objective_gradient.py). With the task part scaled, the reward
weighs 1/std per prompt against the KL, as GRPO's with its KL in the loss, so the KL's weight
against the task is the same at the same beta in both placements.

Before issue 38 the KL was subtracted from the reward before the group statistics: the std of
r - beta c then divided the KL part too, and in a group whose task rewards were all equal the
advantages were the KL's alone divided by its own small std (not J's gradient; about 40x the
anchor pressure beta implies, measured in a rerun). Studies run before that change
(docs/results/decisive, docs/results/kl-in-reward) trained that form.

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

from .advantages import group_advantages


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


def objective_advantages(cfg, guide, rewards, old_logp, entropy, ref_logp, mask) -> tuple[torch.Tensor, dict]:
    """(advantages [G, n], metrics) under ``kl_in_reward``: the task rewards' `group_advantages`
    (``scale_rewards`` as set) minus beta times each completion's `sequence_kl` centred on its
    group's mean, never divided by a std (module docstring). Rows are the completions in group order."""
    log_q = generation_log_q(guide, old_logp, entropy, mask)
    kl = sequence_kl(old_logp, ref_logp, log_q, mask, length_normalized=cfg.kl_in_reward_length_normalized)
    kl = kl.view(rewards.shape)
    advantages, kl_part = advantages_of_j(rewards.to(kl.device), kl, cfg.beta, scale=cfg.scale_rewards)
    tokens = mask.sum().clamp(min=1)
    q = torch.ones_like(old_logp) if log_q is None else log_q.exp()
    metrics = {
        "kl_in_reward/kl": kl.mean(),  # per completion (per token with length normalisation)
        "kl_in_reward/penalty": cfg.beta * kl.mean(),  # beta * KL, what J subtracts on average
        "kl_in_reward/q_mean": torch.where(mask, q, 0.0).sum() / tokens,
        "kl_in_reward/frac_q_gt_1": ((q > 1.0) & mask).sum() / tokens,
        # the KL part's share of the advantages' magnitude
        "kl_in_reward/kl_share": kl_part.abs().sum() / advantages.abs().sum().clamp(min=1e-12),
    }
    return advantages.to(torch.float32), metrics


def advantages_of_j(rewards: torch.Tensor, kl: torch.Tensor, beta: float, *, scale: bool) -> tuple:
    """(advantages, KL part) [G, n] in float64 from task rewards and sequence KLs [G, n]:
    `group_advantages` of the rewards plus -beta (kl - its group mean)."""
    kl_part = -beta * (kl.double() - kl.double().mean(dim=1, keepdim=True))
    return group_advantages(rewards, scale=scale).double() + kl_part, kl_part
