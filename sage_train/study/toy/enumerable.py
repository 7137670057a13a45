"""An RLVR task small enough to enumerate: every completion, its probability and the exact optimum.

A few prompts; completions are all V**L token strings of length L; the reference policy
pi_ref is a fixed autoregressive table (one next-token distribution per prompt and prefix);
the reward is 1 on a few sequences per prompt, some of them rare under pi_ref. A policy is
a table of logits of the same shape [P, N, V] (N prefix nodes per prompt), so every quantity
below is an exact sum over the S = V**L sequences, not an estimate.

Guides are tables of log q per (prompt, prefix node, token). A per-token guide composes into
a sequence-level anchor by the product along the path, Q(x) = pi_ref(x) * prod_t q(s_t, y_t),
the same composition the loss uses when it sums log q into delta per token. With Q held
fixed, J(pi) = E_pi[r] - beta * KL(pi || Q) is maximised by pi* proportional to Q * exp(r / beta).
See docs/convergence.md for the derivations.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from sage_kernels.guides import branch_guide

from ...rl_maths import STD_EPS

DTYPE = torch.float64


@dataclass(frozen=True)
class EnumerableTask:
    """ref_logits [P, N, V]: pi_ref's next-token logits; reward [P, S] in {0, 1}.

    tokens [S, L]: every completion; nodes [S, L]: the prefix node each position is predicted
    from (node 0 is the empty prefix; nodes of depth t follow those of depth t - 1).
    """

    ref_logits: torch.Tensor
    reward: torch.Tensor
    tokens: torch.Tensor
    nodes: torch.Tensor

    @property
    def prompts(self) -> int:
        return self.ref_logits.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.ref_logits.shape[1]

    @property
    def vocab(self) -> int:
        return self.ref_logits.shape[2]

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def sequences(self) -> int:
        return self.tokens.shape[0]


def prefix_tree(vocab: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [V**L, L] in lexicographic order and nodes [V**L, L], the prefix node of each position."""
    tokens = torch.tensor(list(itertools.product(range(vocab), repeat=length)), dtype=torch.long)
    nodes = torch.zeros_like(tokens)
    rank = torch.zeros(tokens.shape[0], dtype=torch.long)  # the prefix read as a base-V number
    for t in range(1, length):
        rank = rank * vocab + tokens[:, t - 1]
        nodes[:, t] = (vocab**t - 1) // (vocab - 1) + rank  # after the nodes shallower than depth t
    return tokens, nodes


def make_task(
    prompts: int = 3,
    vocab: int = 4,
    length: int = 4,
    *,
    seed: int = 0,
    flat_fraction: float = 0.4,
    common: int = 1,
    rare: int = 2,
    rare_prob: float = 1e-3,
    hard: int = 1,
    spread: float | None = None,
) -> EnumerableTask:
    """A random instance: per node, logits N(0, s^2) with s = 0.3 (flat, high entropy) for about
    `flat_fraction` of the nodes and s = 2.5 (peaked) otherwise, so the branch guide sees both.
    With `spread`, the prompts share one such table and each adds its own N(0, spread^2) logits:
    prompts alike, as a language model's are, so what one prompt learns moves the others; their
    common answers are then the same sequences, from the shared table's top tenth.

    Correct answers per prompt: `common` sequences drawn from pi_ref's top tenth and `rare`
    from the tenth whose probability is nearest `rare_prob` in log scale, so exploration has
    something to find that a group of samples seldom sees. The last `hard` prompts have only the
    rare ones, so pass@k at large k is where they show.
    """
    if vocab < 2 or length < 1 or prompts < 1:
        raise ValueError(f"need vocab >= 2, length >= 1, prompts >= 1; got {vocab}, {length}, {prompts}")
    generator = torch.Generator().manual_seed(seed)
    tokens, nodes = prefix_tree(vocab, length)
    num_nodes = (vocab**length - 1) // (vocab - 1)
    tables = prompts if spread is None else 1
    flat = torch.rand(tables, num_nodes, 1, generator=generator, dtype=DTYPE) < flat_fraction
    scale = torch.where(flat, 0.3, 2.5)
    ref_logits = scale * torch.randn(tables, num_nodes, vocab, generator=generator, dtype=DTYPE)
    decile, shared_top = max(1, tokens.shape[0] // 10), None
    if spread is not None:  # the common answers: from the shared table's top tenth
        base_order = sequence_logprobs(ref_logits, tokens, nodes)[0].argsort(descending=True)
        ref_logits = ref_logits + spread * torch.randn(prompts, num_nodes, vocab, generator=generator, dtype=DTYPE)
        shared_top = base_order[torch.randperm(decile, generator=generator)[:common]]
    ref_seq = sequence_logprobs(ref_logits, tokens, nodes)
    reward = torch.zeros_like(ref_seq)
    for p in range(prompts):
        order = ref_seq[p].argsort(descending=True)
        if shared_top is None:
            top = order[torch.randperm(decile, generator=generator)[: common if p < prompts - hard else 0]]
        else:
            top = shared_top if p < prompts - hard else shared_top[:0]
        near = (ref_seq[p] - math.log(rare_prob)).abs().argsort()[:decile]
        reward[p, top] = 1.0
        reward[p, near[torch.randperm(decile, generator=generator)[:rare]]] = 1.0
    return EnumerableTask(ref_logits=ref_logits, reward=reward, tokens=tokens, nodes=nodes)


def sequence_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, nodes: torch.Tensor, log_q: torch.Tensor | None = None
) -> torch.Tensor:
    """log pi(x) [P, S] of every sequence under the node table `logits` [P, N, V]; with `log_q`
    [P, N, V] also add sum_t log q(s_t, y_t), the guide's sequence-level factor."""
    table = torch.log_softmax(logits, dim=-1)
    if log_q is not None:
        table = table + log_q
    return table[:, nodes, tokens].sum(-1)


def task_logprobs(task: EnumerableTask, logits: torch.Tensor, log_q: torch.Tensor | None = None) -> torch.Tensor:
    return sequence_logprobs(logits, task.tokens, task.nodes, log_q)


def node_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H [P, N] (nats) of each node's next-token distribution."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def branch_log_q(logits: torch.Tensor, *, gamma: float, tau: float, q_min: float, q_max: float) -> torch.Tensor:
    """The branch guide [P, N, V] from the entropy of `logits`, the same for every token of a node."""
    q = branch_guide(node_entropy(logits), gamma=gamma, tau=tau, q_min=q_min, q_max=q_max)
    return q.log()[..., None].expand_as(logits).clone()


def token_log_q(logits: torch.Tensor, *, gamma: float, tau: float, q_min: float, q_max: float) -> torch.Tensor:
    """A deterministic token-dependent guide [P, N, V] from the surprisal of the node table `logits`
    (pi_ref's for a fixed guide, the policy's for a recomputed one),
    q = clamp(1 + gamma (-log pi(y|s) - tau)+, q_min, q_max), raising rare tokens. It has no noise
    and no schedule, so that the optimum it defines is exact; the package's token guide
    (`sage_kernels.guides.TokenGuide`) is the official stochastic, annealed one."""
    surprisal = -torch.log_softmax(logits.to(DTYPE), dim=-1)
    q = (1.0 + gamma * (surprisal - tau).clamp(min=0.0)).clamp(q_min, q_max)
    return q.log()


def visitation(task: EnumerableTask, seq_logp: torch.Tensor) -> torch.Tensor:
    """P(reach node) [P, N] under the sequence distribution `seq_logp` [P, S]."""
    prob = seq_logp.exp()
    reach = torch.zeros(task.prompts, task.num_nodes, dtype=DTYPE)
    for t in range(task.length):
        reach.index_add_(1, task.nodes[:, t], prob)
    return reach


def optimum(task: EnumerableTask, log_q: torch.Tensor | None, beta: float) -> torch.Tensor:
    """log pi* [P, S], pi* proportional to pi_ref * prod_t q * exp(r / beta), the maximiser of J."""
    return torch.log_softmax(task_logprobs(task, task.ref_logits, log_q) + task.reward / beta, dim=-1)


def node_log_probs(task: EnumerableTask, seq_logp: torch.Tensor) -> torch.Tensor:
    """The node table [P, N, V] (log next-token probabilities) of a sequence distribution [P, S]:
    at each prefix, P(prefix then y) / P(prefix). Every node must be reached."""
    prob = seq_logp.exp()
    P, N, V = task.prompts, task.num_nodes, task.vocab
    joint = torch.zeros(P, N * V, dtype=DTYPE)
    for t in range(task.length):
        joint.index_add_(1, task.nodes[:, t] * V + task.tokens[:, t], prob)
    joint = joint.reshape(P, N, V)
    return (joint / joint.sum(-1, keepdim=True)).log()


def self_consistent_optimum(task: EnumerableTask, guide, beta: float, *, damping: float = 0.5, tol: float = 1e-12):
    """The optimum of J whose guide is computed from that optimum itself, as SAGE computes q from
    the policy: a pi with pi = pi*(q(pi)). `guide(logits)` gives log q [P, N, V] of a node table.

    Damped fixed-point iteration from pi_ref, logits <- logits + damping * (table of pi*(q(logits))
    - logits), until no entry moves by `tol`. Returns (log pi [P, S], iterations, the last move)."""
    logits = torch.log_softmax(task.ref_logits, dim=-1)
    for iteration in range(1, 100_001):
        move = damping * (node_log_probs(task, optimum(task, guide(logits), beta)) - logits)
        logits = logits + move
        if move.abs().max() < tol:
            break
    return optimum(task, guide(logits), beta), iteration, float(move.abs().max())


def objective(task: EnumerableTask, seq_logp: torch.Tensor, log_q: torch.Tensor | None, beta: float) -> torch.Tensor:
    """J [P] = E_pi[r] - beta * KL(pi || Q), Q = pi_ref * prod_t q (unnormalised when q != 1)."""
    anchor = task_logprobs(task, task.ref_logits, log_q)
    prob = seq_logp.exp()
    return (prob * task.reward).sum(-1) - beta * (prob * (seq_logp - anchor)).sum(-1)


def kl(seq_logp: torch.Tensor, other_logp: torch.Tensor) -> torch.Tensor:
    """KL(pi || other) [P] between two normalised sequence distributions."""
    return (seq_logp.exp() * (seq_logp - other_logp)).sum(-1)


def tv(seq_logp: torch.Tensor, other_logp: torch.Tensor) -> torch.Tensor:
    """Total variation [P] between two sequence distributions."""
    return 0.5 * (seq_logp.exp() - other_logp.exp()).abs().sum(-1)


def pass_at_k(task: EnumerableTask, seq_logp: torch.Tensor, ks) -> torch.Tensor:
    """Exact pass@k [P, len(ks)] = 1 - (1 - P_pi(correct))**k per prompt."""
    correct = (seq_logp.exp() * task.reward).sum(-1).clamp(0.0, 1.0)
    k = torch.tensor(list(ks), dtype=DTYPE)
    return 1.0 - (1.0 - correct[:, None]) ** k


def surrogate_fixed_point(task: EnumerableTask, log_q: torch.Tensor | None) -> torch.Tensor:
    """Node logits [P, N, V] of the per-position fixed point of the k3 term, q * pi_ref / Z_t."""
    table = torch.log_softmax(task.ref_logits, dim=-1)
    return table if log_q is None else table + log_q


def guide_activity(task: EnumerableTask, log_q: torch.Tensor, logits: torch.Tensor) -> dict:
    """How much of the toy a guide touches: the fraction of (node, token) entries with q != 1, plain
    and weighted by how often the policy with node table `logits` takes that token at that node."""
    active = log_q.abs() > 1e-12
    weight = visitation(task, task_logprobs(task, logits))[..., None] * torch.softmax(logits, dim=-1)
    weighted = (weight * active).sum() / weight.sum()
    q = log_q.exp()
    return {
        "fraction_active": float(active.to(DTYPE).mean()),
        "fraction_active_visited": float(weighted),
        "q_mean": float(q.mean()),
        "q_max": float(q.max()),
        "q_min": float(q.min()),
    }


def describe(task: EnumerableTask) -> dict:
    """Sizes and pi_ref's success probabilities, for the report."""
    ref = task_logprobs(task, task.ref_logits)
    hit = ref.exp() * task.reward
    return {
        "prompts": task.prompts,
        "vocab": task.vocab,
        "length": task.length,
        "sequences": task.sequences,
        "nodes": task.num_nodes,
        "correct_per_prompt": task.reward.sum(-1).tolist(),
        "ref_p_correct": hit.sum(-1).tolist(),
        "ref_rarest_correct": torch.where(task.reward > 0, ref, math.inf).min(-1).values.exp().tolist(),
    }


def population_advantages(task: EnumerableTask, seq_logp: torch.Tensor):
    """(r - mean) / (std + 1e-4) under pi per prompt [P, S]: the trainer's `group_advantages` as the
    group grows (its unbiased std tends to this one)."""
    prob, reward = seq_logp.exp(), task.reward
    mean = (prob * reward).sum(-1, keepdim=True)
    std = (prob * (reward - mean) ** 2).sum(-1, keepdim=True).sqrt()
    return (reward - mean) / (std + STD_EPS)


def entropy_quantile(task: EnumerableTask, logits: torch.Tensor, level: float) -> float:
    """The `level` quantile of the next-token entropy at the positions a policy (node table
    `logits`) samples, each node weighted by how often it is reached: what the trainer's token
    entropies would show of it."""
    entropy, weight = node_entropy(logits).flatten(), visitation(task, task_logprobs(task, logits)).flatten()
    order = entropy.argsort()
    cumulative = weight[order].cumsum(0) / weight.sum()
    return float(entropy[order][torch.searchsorted(cumulative, torch.tensor(level, dtype=DTYPE))])


def policy_report(task: EnumerableTask, seq_logp: torch.Tensor, *, optimum, grpo_optimum, log_q, beta, ks) -> dict:
    """Exact quantities of a policy (its sequence log-probs), means over prompts except p_correct:
    TV to `optimum`, to `grpo_optimum` and to pi_ref, J under the anchor of `log_q`, KL to pi_ref,
    P(correct) per prompt and pass@k for each k in `ks`."""
    reference = task_logprobs(task, task.ref_logits)
    return {
        "tv_to_optimum": float(tv(seq_logp, optimum).mean()),
        "tv_to_grpo_optimum": float(tv(seq_logp, grpo_optimum).mean()),
        "tv_to_reference": float(tv(seq_logp, reference).mean()),
        "objective": float(objective(task, seq_logp, log_q, beta).mean()),
        "kl_to_reference": float(kl(seq_logp, reference).mean()),
        "p_correct": (seq_logp.exp() * task.reward).sum(-1).tolist(),
        "pass_at_k": pass_at_k(task, seq_logp, ks).mean(0).tolist(),
    }
