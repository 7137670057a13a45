"""What the SAGE loss converges to, measured exactly on the enumerable task (docs/convergence.md).

The policy is a table of logits: a batch row's `hidden` is the one-hot feature of its prefix
node and `weight` is the table, so every gradient comes out of `fused_linear_sage_loss`
(float64 reference backend). Per algorithm (grpo: no guide; sage-branch: the branch guide;
sage-token: a deterministic token-dependent guide passed as log_q), five ways to train:
(a) exact: the gradient of J = E_pi[r] - beta KL(pi || Q), Q = pi_ref prod_t q held fixed;
(b) expected: the trainer's loss (beta k3, guide recomputed each step, normalised advantages)
    with every sequence weighted by its probability;
(c) sampled: G completions per prompt, `group_advantages`, one on-policy step per batch;
(d), (e): the trainer's ``kl_in_reward`` (`sage_train.rl_maths`) in expectation and sampled,
    q recomputed from the current policy: toward the self-consistent optimum pi = pi*(q(pi)).
    (d) is J's gradient with that q (as the trainer's with an unscaled task part and large groups);
    (e) uses the trainer's `advantages_of_j` (task part scaled by its group std by default).

`python -m sage_train.study.toy.command --out DIR` (= ``sage-study --toy``) writes DIR/toy.json,
DIR/curves.json (TV to the target along training) and plots, then runs the coverage toy
(`sage_train.study.toy.coverage`, one policy table shared by 32 prompts) into DIR/coverage.json
(docs/results/toy.md).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from functools import cached_property, partial
from pathlib import Path

import torch
import torch.nn.functional as F

from sage_kernels import LossConfig, fused_linear_sage_loss

from ...optim import lr_schedule
from ...rl_maths import advantages_of_j, group_advantages, sequence_kl
from . import enumerable as E
from .report import compare, sampled_report

ALGORITHMS = ("grpo", "sage-branch", "sage-token")
BACKEND = "reference"  # float64 and materialised logits: exact, and the tables are tiny
KS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class Options:
    prompts: int = 3
    vocab: int = 4
    length: int = 4
    task_seed: int = 0
    beta: float = 0.25
    gamma: float = 1.0  # branch: 1 + gamma (H - tau)+, with tau below ln V so flat nodes get q > 1
    tau: float = 1.0
    token_gamma: float = 0.3  # the token guide: 1 + gamma (-log pi_ref(y) - tau)+
    token_tau: float = 1.2
    q_min: float = 0.6
    q_max: float = 1.4
    steps: int = 600  # (a) and (b)
    lr: float = 0.05
    sampled_steps: int = 3000
    sampled_lr: float = 0.02
    group_size: int = 8
    seeds: int = 5
    eval_every: int = 25
    hard: int = 1  # the last `hard` prompts have only rare correct answers
    # one logit table shared by the prompts, added to each prompt's pi_ref (the coverage toy,
    # sage_train/study/toy/coverage.py); the prompts' pi_ref share a base table, each spread around it
    shared: bool = False
    spread: float = 0.5
    coverage: int = 32  # the prompts of the coverage toy run after this one (coverage.py); 0: none


class Toy:
    """The task, its guides, fixed anchors and the rows every way feeds to the loss.

    The policy's parameters theta [V, D] are the loss's `weight`. Tabular (the default): one
    column per (prompt, node), D = P N, theta starts at pi_ref's logits. Shared (`opts.shared`):
    one column per node for every prompt, added to the prompt's pi_ref logits, D = N, theta starts
    at 0; a row's `hidden` is then the node's one-hot feature followed by pi_ref's logits at the
    row's (prompt, node), which face an identity block of the weight."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        spread = opts.spread if opts.shared else None
        task = E.make_task(opts.prompts, opts.vocab, opts.length, seed=opts.task_seed, hard=opts.hard, spread=spread)
        self.task = task
        P, S = task.prompts, task.sequences
        self.dim = task.num_nodes if opts.shared else P * task.num_nodes
        self.ref_table = torch.log_softmax(task.ref_logits, dim=-1)
        self.token_log_q = self.guide_log_q("sage-token", task.ref_logits)
        # The anchors held fixed for J: each guide as the first step computes it (at pi_ref).
        self.fixed_log_q = {a: self.guide_log_q(a, task.ref_logits) for a in ALGORITHMS}
        self.optimum = {a: E.optimum(task, self.fixed_log_q[a], opts.beta) for a in ALGORITHMS}
        self.anchor = {a: E.task_logprobs(task, task.ref_logits, self.fixed_log_q[a]) for a in ALGORITHMS}
        self.ref_seq = self.anchor["grpo"]
        # pi = pi*(q(pi)): the guide computed from the optimum itself, as SAGE computes it from the policy
        consistent = {a: E.self_consistent_optimum(task, partial(self.guide_log_q, a), opts.beta) for a in ALGORITHMS}
        self.consistent = {a: c[0] for a, c in consistent.items()}
        self.iterations = {a: c[1:] for a, c in consistent.items()}
        self.full_prompts = torch.arange(P).repeat_interleave(S)
        self.full_seqs = torch.arange(S).repeat(P)

    def guide_log_q(self, algorithm: str, logits: torch.Tensor):
        """log q [P, N, V] of `algorithm`'s guide for the node table `logits`, or None (no guide):
        the branch guide from its entropies, the toy's token guide from its surprisals."""
        o, clamp = self.opts, {"q_min": self.opts.q_min, "q_max": self.opts.q_max}
        if algorithm.startswith("sage-branch"):
            return E.branch_log_q(logits, gamma=o.gamma, tau=o.tau, **clamp)
        if algorithm.startswith("sage-token"):
            return E.token_log_q(logits, gamma=o.token_gamma, tau=o.token_tau, **clamp)
        return None

    def start(self) -> torch.Tensor:
        """theta at pi_ref."""
        return (
            torch.zeros(self.task.vocab, self.dim, dtype=E.DTYPE)
            if self.opts.shared
            else table_of(self.task.ref_logits)
        )

    def weight(self, theta: torch.Tensor, extra: int = 0) -> torch.Tensor:
        """The loss's weight for `theta`, with an identity block facing pi_ref's logits (shared) and
        `extra` identity columns facing zero features (way (b): the rows' logit gradients)."""
        eye = torch.eye(self.task.vocab, dtype=E.DTYPE)
        return torch.cat([theta] + [eye] * (int(self.opts.shared) + (1 if extra else 0)), dim=1)

    def loss(self, algorithm: str, beta: float, hidden, weight, tokens, advantages, token_q=None, **inputs):
        """`fused_linear_sage_loss` in float64 with `algorithm`'s options (TRL's k3 and `grpo` loss type,
        the defaults); sage-token passes its guide as log_q, sage-branch lets the loss compute q."""
        o = self.opts
        guide = "branch" if algorithm == "sage-branch" else "none"
        config = LossConfig(beta=beta, guide=guide, gamma=o.gamma, tau=o.tau, q_min=o.q_min, q_max=o.q_max)
        inputs["log_q"] = token_q if algorithm == "sage-token" else None
        mask = torch.ones_like(tokens, dtype=torch.bool)
        return fused_linear_sage_loss(
            hidden, weight, tokens, mask, advantages, config=config, backend=BACKEND, **inputs
        )

    def rows(self, prompt_ids: torch.Tensor, seq_ids: torch.Tensor, extra: int = 0):
        """Features [B, L, D (+ V shared) + extra] (`Toy`), tokens, theta's columns, pi_ref and
        token-guide log-probs of the rows (prompt, sequence)."""
        task, prompt = self.task, prompt_ids[:, None]
        nodes, tokens = task.nodes[seq_ids], task.tokens[seq_ids]
        cols = nodes if self.opts.shared else prompt * task.num_nodes + nodes
        hidden = F.one_hot(cols, self.dim).to(E.DTYPE)
        if self.opts.shared:
            hidden = torch.cat([hidden, task.ref_logits[prompt, nodes]], dim=-1)
        hidden = F.pad(hidden, (0, extra))
        ref_logp = self.ref_table[prompt, nodes, tokens]
        token_q = self.token_log_q[prompt, nodes, tokens]
        return hidden, tokens, cols, ref_logp, token_q

    @cached_property
    def every_row(self) -> tuple:
        """`rows` of every (prompt, sequence) pair, row p * S + s: built once, indexed by each sampled step."""
        return self.rows(self.full_prompts, self.full_seqs)

    def rows_of(self, prompt_ids: torch.Tensor, seq_ids: torch.Tensor) -> tuple:
        """`rows(prompt_ids, seq_ids)`, taken from `every_row`."""
        index = prompt_ids * self.task.sequences + seq_ids
        return tuple(part[index] for part in self.every_row)

    def logits(self, theta: torch.Tensor) -> torch.Tensor:
        """The policy's node table [P, N, V]."""
        if self.opts.shared:
            return self.task.ref_logits + theta.detach().t()[None]
        return theta.detach().t().reshape(self.task.ref_logits.shape)

    def seq_logp(self, theta: torch.Tensor) -> torch.Tensor:
        return E.task_logprobs(self.task, self.logits(theta))

    def report(self, seq: torch.Tensor, algorithm: str) -> dict:
        """`E.policy_report` against this algorithm's pi* (q at pi_ref), and the TV to its
        self-consistent optimum (q at the optimum itself)."""
        targets = {"optimum": self.optimum[algorithm], "grpo_optimum": self.optimum["grpo"]}
        o = self.opts
        report = E.policy_report(self.task, seq, **targets, log_q=self.fixed_log_q[algorithm], beta=o.beta, ks=KS)
        report["tv_to_consistent"] = float(E.tv(seq, self.consistent[algorithm]).mean())
        return report


# ----------------------------------------------------------------------------- the three ways


def exact_step(toy: Toy, theta: torch.Tensor, algorithm: str, full, *, reward_kl: str = "") -> None:
    """(a): theta.grad = -grad J (averaged over prompts), through the loss with beta 0: the sequence
    advantage f - E_pi f, f = r - beta log(pi / Q), Q = pi_ref prod q with q at pi_ref. With
    `reward_kl`, way (d): the trainer's ``kl_in_reward`` in expectation (its advantage with
    ``scale_rewards: false`` as its groups grow, J's), q "frozen" at pi_ref or "recomputed" from
    the current policy (held fixed within the step, as at generation)."""
    hidden, tokens, _, _, _ = full
    task, seq = toy.task, toy.seq_logp(theta)
    anchor = toy.anchor[algorithm]
    if reward_kl == "recomputed":
        anchor = E.task_logprobs(task, task.ref_logits, toy.guide_log_q(algorithm, toy.logits(theta)))
    value = task.reward - toy.opts.beta * (seq - anchor)
    advantage = value - (seq.exp() * value).sum(-1, keepdim=True)
    # The loss averages rows and positions (1 / (P S L)); weights S L pi(x) make it E_pi per prompt.
    weights = (task.sequences * task.length * seq.exp()).reshape(-1, 1).expand_as(tokens)
    weight = toy.weight(theta)
    toy.loss("grpo", 0.0, hidden, weight, tokens, advantage.reshape(-1), is_weights=weights).loss.backward()


def expected_step(toy: Toy, theta, algorithm: str, full, zero_advantages: bool = False, beta=None) -> float:
    """(b): theta.grad = E_pi[gradient of the trainer's loss] (KL weight `beta`, default the
    options'), every sequence weighted by pi(x). Returns the fraction of positions where q != 1,
    weighted by pi."""
    hidden, tokens, cols, ref_logp, token_q = full
    task, V = toy.task, toy.task.vocab
    seq = toy.seq_logp(theta)
    advantage = torch.zeros_like(seq) if zero_advantages else E.population_advantages(task, seq)
    hidden = hidden.clone().requires_grad_(True)
    weight = toy.weight(theta.detach(), extra=V)
    beta = toy.opts.beta if beta is None else beta
    out = toy.loss(algorithm, beta, hidden, weight, tokens, advantage.reshape(-1), token_q, ref_logp=ref_logp)
    (grad_hidden,) = torch.autograd.grad(out.loss, hidden)
    # Each row's logit gradient carries 1 / (P S L); S pi(x) turns the row mean into E_pi per prompt.
    row_weight = (task.sequences * seq.exp()).reshape(-1, 1, 1)
    per_row = (grad_hidden[..., -V:] * row_weight).reshape(-1, V)
    theta.grad = torch.zeros(toy.dim, V, dtype=E.DTYPE).index_add_(0, cols.reshape(-1), per_row).t()
    prob = seq.exp().reshape(-1, 1)
    return float((prob * (out.q != 1.0)).sum() / (prob.sum() * task.length))


def sampled_step(
    toy: Toy,
    theta: torch.Tensor,
    algorithm: str,
    generator: torch.Generator,
    reward_kl: str = "",
    *,
    scale: bool = True,
    beta: float | None = None,
) -> tuple[float, float]:
    """(c): G samples per prompt, group advantages (normalised by the group's std unless `scale` is
    False), one on-policy step, the loss's KL weight `beta` (default the options'). With `reward_kl`
    ("frozen": q at pi_ref; "recomputed": q from the current policy, as the trainer does), the
    trainer's ``kl_in_reward`` (way (e)): `advantages_of_j` of the task rewards and each sample's
    `sequence_kl` with the options' beta, beta 0 in the loss. Returns the guide's mean q and share
    of q > 1 over the sampled tokens, where it acts (the loss, or the reward's KL)."""
    task, G = toy.task, toy.opts.group_size
    draws = torch.multinomial(toy.seq_logp(theta).exp(), G, replacement=True, generator=generator)
    prompts = torch.arange(task.prompts).repeat_interleave(G)
    hidden, tokens, _, ref_logp, token_q = toy.rows_of(prompts, draws.reshape(-1))
    reward, beta = task.reward.gather(1, draws), toy.opts.beta if beta is None else beta
    if reward_kl:
        logits, at = toy.logits(theta), (prompts[:, None], task.nodes[draws.reshape(-1)], tokens)
        table = toy.guide_log_q(algorithm, logits) if reward_kl == "recomputed" else toy.fixed_log_q[algorithm]
        old_logp = torch.log_softmax(logits, dim=-1)[at]
        log_q = torch.zeros_like(old_logp) if table is None else table[at]
        kl = sequence_kl(old_logp, ref_logp, log_q, torch.ones_like(tokens).bool())
        advantage = advantages_of_j(reward, kl.view(reward.shape), toy.opts.beta, scale=scale)[0].reshape(-1)
        beta, algorithm = 0.0, "grpo"
    else:
        advantage = group_advantages(reward, scale=scale).reshape(-1)
    out = toy.loss(algorithm, beta, hidden, toy.weight(theta), tokens, advantage, token_q, ref_logp=ref_logp)
    out.loss.backward()
    q = log_q.exp() if reward_kl else out.q
    return float(q.mean()), float((q > 1.0).to(E.DTYPE).mean())


def train(toy: Toy, step, theta0: torch.Tensor, target: torch.Tensor, *, sampled: bool = False):
    """Adam on the table: for (c) at a constant rate (the trainer's default), otherwise on a cosine to 0,
    so a deterministic way lands on its fixed point instead of hovering at Adam's step size.

    Returns the final table, the TV to `target` every eval_every steps, and the sequence
    distribution averaged over the evaluations of the second half: where a noisy run settles.
    """
    o = toy.opts
    steps, lr = (o.sampled_steps, o.sampled_lr) if sampled else (o.steps, o.lr)
    theta = theta0.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([theta], lr=lr)
    schedule = lr_schedule(optimizer, "constant" if sampled else "cosine", 0, steps)
    seq = toy.seq_logp(theta)
    curve, tail = [[0, float(E.tv(seq, target).mean())]], []
    for i in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        step(theta)
        optimizer.step()
        schedule.step()
        if i % o.eval_every == 0 or i == steps:
            seq = toy.seq_logp(theta)
            curve.append([i, float(E.tv(seq, target).mean())])
            if 2 * i > steps:
                tail.append(seq.exp())
    return theta.detach(), curve, torch.stack(tail).mean(0).log()


def table_of(logits: torch.Tensor) -> torch.Tensor:
    """The loss's weight [V, P*N] for node logits [P, N, V]."""
    return logits.reshape(-1, logits.shape[-1]).t().contiguous()


def run(opts: Options, log=print) -> dict:
    start, toy = time.perf_counter(), Toy(opts)
    task, ref_theta = toy.task, toy.start()
    full = toy.rows(toy.full_prompts, toy.full_seqs)
    full_aug = toy.rows(toy.full_prompts, toy.full_seqs, extra=task.vocab)
    activity = {a: E.guide_activity(task, toy.fixed_log_q[a], task.ref_logits) for a in ("sage-branch", "sage-token")}
    result = {
        "options": asdict(opts),
        "task": E.describe(task),
        "ks": list(KS),
        "guide_activity_at_reference": activity,
    }
    result["reference"] = toy.report(toy.ref_seq, "grpo")
    result["optimum"] = {a: toy.report(toy.optimum[a], a) for a in ALGORITHMS}
    result["self_consistent"] = {a: toy.report(toy.consistent[a], a) for a in ALGORITHMS}
    for a in ALGORITHMS:
        result["self_consistent"][a]["iterations"], result["self_consistent"][a]["last_move"] = toy.iterations[a]

    def done(way: str, a: str, text: str) -> None:
        log(f"({way}) {a:12s} {text}  [{time.perf_counter() - start:.0f}s]")

    curves, ends = {}, {}
    for way, mode, target in (("exact", "", toy.optimum), ("reward_expected", "recomputed", toy.consistent)):
        for a in ALGORITHMS:  # (a) and (d)
            step = partial(exact_step, toy, algorithm=a, full=full, reward_kl=mode)
            theta, curves[way, a], _ = train(toy, step, ref_theta, target[a])
            result.setdefault(way, {})[a] = report = toy.report(toy.seq_logp(theta), a)
            done(way, a, "tv to pi* {tv_to_optimum:.2e}, to self-consistent {tv_to_consistent:.2e}".format(**report))
    for a in ALGORITHMS:
        active = []  # the probability-weighted fraction of positions with q != 1, per step

        def step(theta, a=a):
            active.append(expected_step(toy, theta, a, full_aug))

        theta, curves["expected", a], _ = train(toy, step, ref_theta, toy.optimum[a])
        ends[a] = toy.seq_logp(theta)
        result.setdefault("expected", {})[a] = toy.report(ends[a], a)
        result["expected"][a]["guided_fraction_first_last"] = [active[0], active[-1]]
        done("expected", a, f"tv to pi* {result['expected'][a]['tv_to_optimum']:.4f}")

    # (b) with zero advantages: only the k3 term, pulling toward q pi_ref / Z_t per node. The branch and
    # no-guide fixed point is pi_ref itself, so those start from a perturbed table to have somewhere to go.
    noise = torch.randn(ref_theta.shape, generator=torch.Generator().manual_seed(1), dtype=E.DTYPE)
    for a in ALGORITHMS:
        fixed = E.task_logprobs(task, E.surrogate_fixed_point(task, toy.fixed_log_q[a] if a == "sage-token" else None))
        step = partial(expected_step, toy, algorithm=a, full=full_aug, zero_advantages=True)
        theta, curves["kl_only", a], _ = train(toy, step, ref_theta + (0 if a == "sage-token" else noise), fixed)
        tv_fixed, tv_ref = float(E.tv(toy.seq_logp(theta), fixed).mean()), float(E.tv(fixed, toy.ref_seq).mean())
        result.setdefault("kl_only", {})[a] = {"tv_to_fixed_point": tv_fixed, "fixed_point_tv_to_reference": tv_ref}
        done("kl only", a, f"tv to q pi_ref / Z_t {tv_fixed:.2e}")

    sampled_end = {}
    for way, mode, target in (("sampled", "", toy.optimum), ("reward_sampled", "recomputed", toy.consistent)):
        for a in ALGORITHMS:  # (c) and (e)
            sampled_end[way, a] = []
            for seed in range(opts.seeds):
                generator = torch.Generator().manual_seed(1000 + seed)  # the same seeds for every algorithm
                step = partial(sampled_step, toy, algorithm=a, generator=generator, reward_kl=mode)
                theta, curves[way, a, seed], settled = train(toy, step, ref_theta, target[a], sampled=True)
                sampled_end[way, a].append((toy.seq_logp(theta), settled))
            expected_end = ends[a] if way == "sampled" else toy.consistent[a]
            result.setdefault(way, {})[a] = sampled_report(toy, a, sampled_end[way, a], expected_end)
            text = "tv to pi* {tv_to_optimum:.4f}, to (b) or self-consistent {tv_to_expected:.4f}, 2nd half "
            done(way, a, (text + "{settled_tv_to_expected:.4f}").format(**result[way][a]))

    result["tv_exact_objective"] = max(result["exact"][a]["tv_to_optimum"] for a in ALGORITHMS)
    result["tv_reward_expected"] = max(result["reward_expected"][a]["tv_to_consistent"] for a in ALGORITHMS)
    result["tv_kl_only_surrogate"] = max(result["kl_only"][a]["tv_to_fixed_point"] for a in ALGORITHMS)
    result["branch_vs_grpo"] = compare(result, ends, sampled_end)
    result["curves"] = {" ".join(map(str, key)): curve for key, curve in curves.items()}
    result["wall_seconds"] = time.perf_counter() - start
    return result


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


#: the options' admissible ranges, checked before anything runs
RULES = (
    (
        "> 0",
        lambda v: v > 0,
        ("prompts", "length", "steps", "sampled_steps", "seeds", "eval_every", "beta", "lr", "sampled_lr", "q_min"),
    ),
    (">= 2", lambda v: v >= 2, ("vocab", "group_size")),
    (">= 0", lambda v: v >= 0, ("gamma", "token_gamma", "hard", "spread", "coverage")),
    (">= 1", lambda v: v >= 1, ("q_max",)),
    ("<= 1", lambda v: v <= 1, ("q_min",)),
)


def parse(argv: list[str]) -> tuple[Path, Options]:
    parser = _Parser(prog="sage-study --toy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for toy.json and the plots")
    for name, value in asdict(Options()).items():
        if name != "shared":  # the coverage toy's (coverage.py), not a flag
            parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    out, opts = Path(args.pop("out")), Options(**args)
    for rule, holds, names in RULES:
        for name in names:
            value = getattr(opts, name)
            if not holds(value):
                raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {value}")
    if opts.hard > opts.prompts:
        raise ValueError(f"--hard must be <= --prompts ({opts.prompts}), got {opts.hard}")
    if opts.vocab**opts.length > 4096:
        raise ValueError(f"--vocab ** --length must be <= 4096 to enumerate, got {opts.vocab**opts.length}")
    return out, opts
