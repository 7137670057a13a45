"""``kl_in_reward``'s advantages are J's: on an enumerable task, the sampled advantage-weighted
gradient sum_i A_i grad log pi(y_i) of the trainer's `objective_advantages`, averaged over many
groups, equals the exact gradient of J(pi) = E_pi[r] - beta KL(pi || Q) (Q = pi_ref prod_t q with q
the branch guide's at the current policy, held fixed) times (n - 1) / n, within Monte-Carlo error,
on prompts whose groups are mixed and on prompts whose task rewards are always equal. The form
used before issue 38 (the group statistics of r - beta c, scaled by their std as the presets do)
is far outside that error."""

import pytest
import torch
from run_copies import TINY_RUN

from sage_train.config import build, resolve
from sage_train.guide import make_guide
from sage_train.inputs import run_settings
from sage_train.rl_maths import group_advantages, objective_advantages, sequence_kl
from sage_train.study.toy import enumerable as E

VOCAB, LENGTH, GROUP, GROUPS = 3, 2, 4, 20_000
BETA = 0.2
#: the prompts' rewards over the 9 sequences: mixed (groups both all-equal and not), never correct,
#: always correct (every group of the last two has equal task rewards)
REWARDS = [[1, 0, 0, 0, 1, 0, 0, 0, 1], [0] * 9, [1] * 9]


def setting():
    tokens, nodes = E.prefix_tree(VOCAB, LENGTH)
    g = torch.Generator().manual_seed(0)
    prompts = len(REWARDS)
    ref_logits = torch.randn(prompts, nodes.max() + 1, VOCAB, generator=g, dtype=E.DTYPE)
    logits = ref_logits + 0.8 * torch.randn(ref_logits.shape, generator=g, dtype=E.DTYPE)
    logits[:, 0] *= 0.2  # a flat first node: entropy above tau, q > 1 there
    task = E.EnumerableTask(ref_logits, torch.tensor(REWARDS, dtype=E.DTYPE), tokens, nodes)
    return task, logits


def exact_grad_j(task, logits, log_q) -> torch.Tensor:
    """d J / d logits [P, N, V] by autograd, Q held fixed."""
    theta = logits.clone().requires_grad_(True)
    E.objective(task, E.task_logprobs(task, theta), log_q.detach(), BETA).sum().backward()
    return theta.grad


def scores(task, logits) -> torch.Tensor:
    """d log pi(x | p) / d logits[p] [P, S, N * V]."""
    jac = torch.autograd.functional.jacobian(lambda t: E.task_logprobs(task, t), logits)  # [P, S, P, N, V]
    P = task.prompts
    return torch.stack([jac[p, :, p].reshape(task.sequences, -1) for p in range(P)])


def sampled_estimates(task, logits, cfg, *, old_form=False) -> torch.Tensor:
    """Per group, sum_i A_i grad log pi(y_i) / (n - 1) [P, GROUPS, N * V] (its expectation is grad J_p
    when A is J's advantage with an unscaled task part)."""
    P, n = task.prompts, GROUP
    pi = E.task_logprobs(task, logits).exp()
    draws = torch.multinomial(
        pi.repeat_interleave(GROUPS, 0), n, replacement=True, generator=torch.Generator().manual_seed(1)
    )
    seqs = draws.reshape(-1)  # rows: prompt-major, then group, then member
    prompt = torch.arange(P).repeat_interleave(GROUPS * n)[:, None]
    at = (prompt, task.nodes[seqs], task.tokens[seqs])
    old_logp = torch.log_softmax(logits, -1)[at]
    ref_logp = torch.log_softmax(task.ref_logits, -1)[at]
    entropy = E.node_entropy(logits)[at[:2]]
    mask = torch.ones_like(old_logp, dtype=torch.bool)
    rewards = task.reward.gather(1, draws.reshape(P, -1)).reshape(-1, n).float()
    guide = run_guide(cfg)
    if old_form:  # before issue 38: the group statistics of the shaped reward r - beta c
        kl = sequence_kl(old_logp, ref_logp, guide.log_q(old_logp, entropy, mask), mask)
        advantages = group_advantages(rewards - BETA * kl.float().view(rewards.shape), scale=cfg.scale_rewards)
    else:
        reward = run_settings(cfg).reward
        advantages, _ = objective_advantages(reward, guide, rewards, old_logp, entropy, ref_logp, mask)
    score = scores(task, logits)[prompt[:, 0], seqs]  # [rows, N * V]
    weighted = advantages.double().reshape(-1, 1) * score
    return weighted.reshape(P, GROUPS, n, -1).sum(2) / (n - 1)


def z_scores(estimates, exact) -> torch.Tensor:
    """(mean - exact) / standard error per coordinate; coordinates the estimate never moves must match exactly."""
    mean, se = estimates.mean(1), estimates.std(1) / GROUPS**0.5
    still = se < 1e-13
    assert ((mean - exact)[still].abs() < 1e-12).all()
    return torch.where(still, 0.0, (mean - exact) / se.clamp(min=1e-13))


def run_guide(cfg):
    """The guide a run of `cfg` makes on rank 0 (as `build` does)."""
    s = run_settings(cfg)
    return make_guide(s.run.guide, s.loss, s.guide, steps=s.run.steps, seed=s.run.seed, rank=0)


def kl_config(scale: bool):
    keys = {"algorithm": "sage-branch-exact", "beta": BETA, "tau": 0.9, "gamma": 2.0, "scale_rewards": scale}
    return resolve(build({**TINY_RUN, **keys}))


@pytest.mark.parametrize("scale", [False, True])
def test_kl_in_reward_advantages_estimate_grad_j(scale):
    task, logits = setting()
    cfg = kl_config(scale)
    guide = run_guide(cfg)
    log_q = E.branch_log_q(logits, gamma=guide.gamma, tau=guide.tau, q_min=guide.q_min, q_max=guide.q_max)
    assert (log_q[:, 0] > 0).all() and (log_q == 0).any()  # the guide raises some nodes and not others
    exact = exact_grad_j(task, logits, log_q).reshape(task.prompts, -1)
    estimates = sampled_estimates(task, logits, cfg)
    # scaled, the task part is GRPO's (1/std per group), not grad E[r]: J's gradient is checked where
    # the task rewards are all equal, which the KL part alone drives
    prompts = range(task.prompts) if not scale else [1, 2]
    z = z_scores(estimates[list(prompts)], exact[list(prompts)])
    assert z.abs().max() < 4.5, z
    assert exact[list(prompts)].abs().max() > 0.01  # a gradient to estimate, not zeros
    if scale:  # the form before issue 38 (unscaled it is the same): far outside the error where rewards are equal
        old = z_scores(sampled_estimates(task, logits, cfg, old_form=True)[[1, 2]], exact[[1, 2]])
        assert old.abs().max() > 50, old
