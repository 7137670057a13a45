"""What the SAGE loss converges to, measured exactly on the enumerable task (docs/convergence.md).

The policy is a table of logits: a batch row's `hidden` is the one-hot feature of its prefix
node and `weight` is the table, so every gradient comes out of `fused_linear_sage_loss`
(float64 reference backend). Per algorithm (grpo: no guide; sage-branch: the branch guide;
sage-token: a fixed token-dependent guide passed as log_q), three ways to train:
(a) exact: the gradient of J = E_pi[r] - beta KL(pi || Q), Q = pi_ref prod_t q held fixed;
(b) expected: the trainer's loss (beta k3, guide recomputed each step, normalised advantages)
    with every sequence weighted by its probability;
(c) sampled: G completions per prompt, `group_advantages`, one on-policy step per batch.

`python -m sage_train.toy --out DIR` writes DIR/toy.json, DIR/curves.json (TV to the target along
training) and plots (docs/results/toy.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sage_kernels import LossConfig, fused_linear_sage_loss
from sage_train.advantages import STD_EPS, group_advantages
from sage_train.tasks import enumerable as E

ALGORITHMS = ("grpo", "sage-branch", "sage-token")
KS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


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


class Toy:
    """The task, its guides, fixed anchors and the rows every way feeds to the loss."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.task = task = E.make_task(opts.prompts, opts.vocab, opts.length, seed=opts.task_seed)
        P, S = task.prompts, task.sequences
        self.dim = P * task.num_nodes
        self.ref_table = torch.log_softmax(task.ref_logits, dim=-1)
        self.token_log_q = E.token_log_q(task.ref_logits, gamma=opts.token_gamma, tau=opts.token_tau,
                                         q_min=opts.q_min, q_max=opts.q_max)
        # The anchors held fixed for J: the branch guide as the first step computes it (at pi_ref).
        self.fixed_log_q = {"grpo": None, "sage-token": self.token_log_q,
                            "sage-branch": E.branch_log_q(task.ref_logits, gamma=opts.gamma, tau=opts.tau,
                                                          q_min=opts.q_min, q_max=opts.q_max)}
        self.optimum = {a: E.optimum(task, self.fixed_log_q[a], opts.beta) for a in ALGORITHMS}
        self.anchor = {a: E.task_logprobs(task, task.ref_logits, self.fixed_log_q[a]) for a in ALGORITHMS}
        self.ref_seq = self.anchor["grpo"]
        self.full_prompts = torch.arange(P).repeat_interleave(S)
        self.full_seqs = torch.arange(S).repeat(P)
        self.full_mask = torch.ones(P * S, task.length, dtype=torch.bool)

    def config(self, algorithm: str, beta: float) -> LossConfig:
        o = self.opts
        return LossConfig(beta=beta, kl="k3", guide="branch" if algorithm == "sage-branch" else "none",
                          gamma=o.gamma, tau=o.tau, q_min=o.q_min, q_max=o.q_max, loss_type="grpo")

    def rows(self, prompt_ids: torch.Tensor, seq_ids: torch.Tensor, extra: int = 0):
        """One-hot prefix features [B, L, P*N + extra], tokens, table columns, pi_ref and token-guide log-probs."""
        task = self.task
        nodes, tokens = task.nodes[seq_ids], task.tokens[seq_ids]
        cols = prompt_ids[:, None] * task.num_nodes + nodes
        hidden = F.one_hot(cols, self.dim + extra).to(E.DTYPE)
        ref_logp = self.ref_table[prompt_ids[:, None], nodes, tokens]
        token_q = self.token_log_q[prompt_ids[:, None], nodes, tokens]
        return hidden, tokens, cols, ref_logp, token_q

    def logits(self, theta: torch.Tensor) -> torch.Tensor:
        return theta.detach().t().reshape(self.task.ref_logits.shape)

    def seq_logp(self, theta: torch.Tensor) -> torch.Tensor:
        return E.task_logprobs(self.task, self.logits(theta))

    def log_q_rows(self, algorithm: str, token_q: torch.Tensor):  # only sage-token passes an explicit guide
        return token_q if algorithm == "sage-token" else None


# ----------------------------------------------------------------------------- the three ways


def exact_step(toy: Toy, theta: torch.Tensor, algorithm: str, full) -> None:
    """(a): theta.grad = -grad J (averaged over prompts), through the loss with beta 0."""
    hidden, tokens, _, _, _ = full
    seq = toy.seq_logp(theta)
    value = toy.task.reward - toy.opts.beta * (seq - toy.anchor[algorithm])
    advantage = value - (seq.exp() * value).sum(-1, keepdim=True)
    # The loss averages rows and positions (1 / (P S L)); weights S L pi(x) make it E_pi per prompt.
    weights = (toy.task.sequences * toy.task.length * seq.exp()).reshape(-1, 1).expand_as(tokens)
    out = fused_linear_sage_loss(hidden, theta, tokens, toy.full_mask, advantage.reshape(-1), is_weights=weights,
                                 config=toy.config("grpo", 0.0), backend="reference")
    out.loss.backward()


def population_advantages(reward: torch.Tensor, seq_logp: torch.Tensor) -> torch.Tensor:
    """(r - mean) / (std + 1e-4) under pi per prompt: `group_advantages` as the group grows."""
    prob = seq_logp.exp()
    mean = (prob * reward).sum(-1, keepdim=True)
    std = (prob * (reward - mean) ** 2).sum(-1, keepdim=True).sqrt()
    return (reward - mean) / (std + STD_EPS)


def expected_step(toy: Toy, theta: torch.Tensor, algorithm: str, full, zero_advantages: bool = False) -> float:
    """(b): theta.grad = E_pi[gradient of the trainer's loss], every sequence weighted by pi(x).
    Returns the fraction of positions where q != 1, weighted by pi."""
    hidden, tokens, cols, ref_logp, token_q = full
    task, V = toy.task, toy.task.vocab
    seq = toy.seq_logp(theta)
    advantage = torch.zeros_like(seq) if zero_advantages else population_advantages(task.reward, seq)
    hidden = hidden.clone().requires_grad_(True)
    weight = torch.cat([theta.detach(), torch.eye(V, dtype=E.DTYPE)], dim=1)
    out = fused_linear_sage_loss(hidden, weight, tokens, toy.full_mask, advantage.reshape(-1), ref_logp=ref_logp,
                                 log_q=toy.log_q_rows(algorithm, token_q), config=toy.config(algorithm, toy.opts.beta),
                                 backend="reference")
    (grad_hidden,) = torch.autograd.grad(out.loss, hidden)
    # Each row's logit gradient carries 1 / (P S L); S pi(x) turns the row mean into E_pi per prompt.
    row_weight = (task.sequences * seq.exp()).reshape(-1, 1, 1)
    per_row = (grad_hidden[..., toy.dim:] * row_weight).reshape(-1, V)
    theta.grad = torch.zeros(toy.dim, V, dtype=E.DTYPE).index_add_(0, cols.reshape(-1), per_row).t()
    prob = seq.exp().reshape(-1, 1)
    return float((prob * (out.q != 1.0)).sum() / (prob.sum() * task.length))


def sampled_step(toy: Toy, theta: torch.Tensor, algorithm: str, generator: torch.Generator) -> None:
    """(c): G samples per prompt, group-normalised advantages, one on-policy step."""
    task, G = toy.task, toy.opts.group_size
    draws = torch.multinomial(toy.seq_logp(theta).exp(), G, replacement=True, generator=generator)
    advantage = group_advantages(task.reward.gather(1, draws)).reshape(-1)
    hidden, tokens, _, ref_logp, token_q = toy.rows(torch.arange(task.prompts).repeat_interleave(G), draws.reshape(-1))
    out = fused_linear_sage_loss(hidden, theta, tokens, torch.ones_like(tokens, dtype=torch.bool), advantage,
                                 ref_logp=ref_logp, log_q=toy.log_q_rows(algorithm, token_q),
                                 config=toy.config(algorithm, toy.opts.beta), backend="reference")
    out.loss.backward()


def train(toy: Toy, step, theta0: torch.Tensor, steps: int, lr: float, target: torch.Tensor, *, cosine: bool):
    """Adam on the table, its rate constant (as the trainer's default) or on a cosine to 0 (so a
    deterministic way lands on its fixed point instead of hovering at Adam's step size).

    Returns the final table, the TV to `target` every eval_every steps, and the sequence
    distribution averaged over the evaluations of the second half: where a noisy run settles.
    """
    theta = theta0.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([theta], lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: 0.5 * (1 + math.cos(math.pi * i / steps)) if cosine else 1.0)
    seq = toy.seq_logp(theta)
    curve, tail = [[0, float(E.tv(seq, target).mean())]], []
    for i in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        step(theta)
        optimizer.step()
        schedule.step()
        if i % toy.opts.eval_every == 0 or i == steps:
            seq = toy.seq_logp(theta)
            curve.append([i, float(E.tv(seq, target).mean())])
            if 2 * i > steps:
                tail.append(seq.exp())
    return theta.detach(), curve, torch.stack(tail).mean(0).log()


def summary(toy: Toy, seq: torch.Tensor, algorithm: str) -> dict:
    """Exact quantities of a policy given by its sequence log-probs, against `algorithm`'s optimum."""
    beta, log_q = toy.opts.beta, toy.fixed_log_q[algorithm]
    return {"tv_to_optimum": float(E.tv(seq, toy.optimum[algorithm]).mean()),
            "tv_to_grpo_optimum": float(E.tv(seq, toy.optimum["grpo"]).mean()),
            "tv_to_reference": float(E.tv(seq, toy.ref_seq).mean()),
            "objective": float(E.objective(toy.task, seq, log_q, beta).mean()),
            "kl_to_reference": float(E.kl(seq, toy.ref_seq).mean()),
            "p_correct": (seq.exp() * toy.task.reward).sum(-1).tolist(),
            "pass_at_k": E.pass_at_k(toy.task, seq, KS).mean(0).tolist()}


def table_of(logits: torch.Tensor) -> torch.Tensor:
    """The loss's weight [V, P*N] for node logits [P, N, V]."""
    return logits.reshape(-1, logits.shape[-1]).t().contiguous()


# ----------------------------------------------------------------------------- the run


def run(opts: Options, log=print) -> dict:
    start, toy = time.perf_counter(), Toy(opts)
    task, ref_theta = toy.task, table_of(toy.task.ref_logits)
    full = toy.rows(toy.full_prompts, toy.full_seqs)
    full_aug = toy.rows(toy.full_prompts, toy.full_seqs, extra=task.vocab)
    result = {"options": asdict(opts), "task": E.describe(task), "ks": list(KS),
              "guide_activity_at_reference": {a: E.guide_activity(task, toy.fixed_log_q[a], task.ref_logits)
                                              for a in ("sage-branch", "sage-token")},
              "reference": summary(toy, toy.ref_seq, "grpo"),
              "optimum": {a: summary(toy, toy.optimum[a], a) for a in ALGORITHMS}}
    curves, expected_end = {}, {}
    for way in ("exact", "expected"):
        result[way] = {}
        for a in ALGORITHMS:
            guided = []  # (b): the probability-weighted fraction of positions with q != 1, per step
            step = (lambda th, a=a: exact_step(toy, th, a, full)) if way == "exact" else (
                lambda th, a=a: guided.append(expected_step(toy, th, a, full_aug)))
            theta, curves[way, a], _ = train(toy, step, ref_theta, opts.steps, opts.lr, toy.optimum[a], cosine=True)
            result[way][a] = summary(toy, toy.seq_logp(theta), a)
            if way == "expected":
                result[way][a]["guided_fraction_first_last"] = [guided[0], guided[-1]]
                expected_end[a] = toy.seq_logp(theta)
            log(f"({way}) {a:12s} tv to pi* {result[way][a]['tv_to_optimum']:.4f}  "
                f"pass@1 {result[way][a]['pass_at_k'][0]:.3f}  [{time.perf_counter() - start:.0f}s]")

    # (b) with zero advantages: only the k3 term, pulling toward q pi_ref / Z_t per node. The branch and
    # no-guide fixed point is pi_ref itself, so those start from a perturbed table to have somewhere to go.
    result["kl_only"] = {}
    noise = torch.randn(ref_theta.shape, generator=torch.Generator().manual_seed(1), dtype=E.DTYPE)
    for a in ALGORITHMS:
        start_theta = ref_theta if a == "sage-token" else ref_theta + noise
        fixed = E.task_logprobs(task, E.surrogate_fixed_point(task, toy.log_q_rows(a, toy.token_log_q)))
        theta, curves["kl_only", a], _ = train(toy, lambda th, a=a: expected_step(toy, th, a, full_aug, True),
                                               start_theta, opts.steps, opts.lr, fixed, cosine=True)
        result["kl_only"][a] = {"tv_to_fixed_point": float(E.tv(toy.seq_logp(theta), fixed).mean()),
                                "fixed_point_tv_to_reference": float(E.tv(fixed, toy.ref_seq).mean())}
        log(f"(kl only) {a:12s} tv to q pi_ref / Z_t {result['kl_only'][a]['tv_to_fixed_point']:.4f}")

    result["sampled"], sampled_end = {}, {}
    for a in ALGORITHMS:
        runs, sampled_end[a] = [], []
        for seed in range(opts.seeds):
            generator = torch.Generator().manual_seed(1000 + seed)  # the same seeds for every algorithm
            theta, curves["sampled", a, seed], settled = train(
                toy, lambda th, a=a, g=generator: sampled_step(toy, th, a, g), ref_theta, opts.sampled_steps,
                opts.sampled_lr, toy.optimum[a], cosine=False)
            sampled_end[a].append((seq := toy.seq_logp(theta), settled))
            runs.append(dict(summary(toy, seq, a), tv_to_expected=float(E.tv(seq, expected_end[a]).mean()),
                             settled_tv_to_optimum=float(E.tv(settled, toy.optimum[a]).mean()),
                             settled_tv_to_expected=float(E.tv(settled, expected_end[a]).mean()),
                             settled_pass_at_k=E.pass_at_k(task, settled, KS).mean(0).tolist()))
        result["sampled"][a] = {"per_seed": runs, **{key: mean([r[key] for r in runs]) for key in runs[0]}}
        log(f"(sampled) {a:12s} tv to pi* {result['sampled'][a]['tv_to_optimum']:.4f}  "
            f"tv to (b) {result['sampled'][a]['tv_to_expected']:.4f}  settled: to pi* "
            f"{result['sampled'][a]['settled_tv_to_optimum']:.4f}, to (b) "
            f"{result['sampled'][a]['settled_tv_to_expected']:.4f}  [{time.perf_counter() - start:.0f}s]")

    result["tv_exact_objective"] = max(result["exact"][a]["tv_to_optimum"] for a in ALGORITHMS)
    result["tv_kl_only_surrogate"] = max(result["kl_only"][a]["tv_to_fixed_point"] for a in ALGORITHMS)
    result["branch_vs_grpo"] = compare(result, expected_end, sampled_end)
    result["curves"] = {" ".join(map(str, key)): curve for key, curve in curves.items()}
    result["wall_seconds"] = time.perf_counter() - start
    return result


def mean(values):
    """Mean over seeds of numbers, or elementwise of equal-length lists."""
    return [sum(c) / len(c) for c in zip(*values)] if isinstance(values[0], list) else sum(values) / len(values)


def compare(result: dict, expected_end: dict, sampled_end: dict) -> dict:
    """How far sage-branch ends from grpo, per way: pass@k differences; for (b) the TV between the two
    ends; for (c) the TV between a branch seed and a grpo seed against that between two grpo seeds
    (the noise floor), for the final tables and the second-half averages, and the paired pass@1 gaps."""
    out = {}
    for way in ("optimum", "exact", "expected", "sampled"):
        diff = [b - g for b, g in zip(result[way]["sage-branch"]["pass_at_k"], result[way]["grpo"]["pass_at_k"])]
        out[way] = {"pass_at_k_difference": diff, "max_abs_pass_at_k_difference": max(abs(d) for d in diff)}
    out["expected"]["tv_between"] = float(E.tv(expected_end["sage-branch"], expected_end["grpo"]).mean())
    seeds = range(len(sampled_end["grpo"]))
    for i, name in enumerate(("final", "settled")):
        pairs = [(j, k) for j in seeds for k in seeds if j != k]
        tv = {a: mean([float(E.tv(sampled_end[a][j][i], sampled_end["grpo"][k][i]).mean()) for j, k in pairs])
              for a in ("sage-branch", "grpo")} if pairs else {}
        out["sampled"][f"tv_{name}_branch_to_grpo_seeds"] = tv.get("sage-branch")
        out["sampled"][f"tv_{name}_grpo_to_grpo_seeds"] = tv.get("grpo")
    gaps = [b["pass_at_k"][0] - g["pass_at_k"][0] for b, g in zip(*(result["sampled"][a]["per_seed"]
                                                                   for a in ("sage-branch", "grpo")))]
    out["sampled"]["pass_at_1_paired_gaps"] = gaps
    return out


def plot(result: dict, out: Path) -> list[str]:
    """tv_curves.png (TV to the target along training, per way) and pass_at_k.png (exact curves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"grpo": "tab:blue", "sage-branch": "tab:red", "sage-token": "tab:green"}
    titles = {"exact": "(a) exact gradient of J", "expected": "(b) the loss in expectation",
              "kl_only": "(b) zero advantages, to q pi_ref / Z_t", "sampled": "(c) sampled, G per prompt"}
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6), sharey=True)
    for ax, way in zip(axes, titles):
        for key, curve in result["curves"].items():
            parts = key.split(" ")
            if parts[0] == way:
                ax.plot(*zip(*curve), color=colours[parts[1]], alpha=0.5 if way == "sampled" else 1.0,
                        label=parts[1] if len(parts) == 2 or parts[2] == "0" else None)
        ax.set_yscale("symlog", linthresh=1e-3)  # TV spans 1 down to the 1e-6 of a converged way
        ax.set(title=titles[way], xlabel="step")
    axes[0].set_ylabel("TV to target (mean over prompts)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tv_curves.png", dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot(result["ks"], result["reference"]["pass_at_k"], color="black", marker=".", label="pi_ref")
    for way, style in (("optimum", "-"), ("expected", "--"), ("sampled", ":")):
        for a in ALGORITHMS:
            ax.plot(result["ks"], result[way][a]["pass_at_k"], color=colours[a], linestyle=style, marker=".",
                    label=f"{way} {a}")
    ax.set(xscale="log", xlabel="k", ylabel="exact pass@k (mean over prompts)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "pass_at_k.png", dpi=80)
    plt.close(fig)
    return ["tv_curves.png", "pass_at_k.png"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


#: the options' admissible ranges, checked before anything runs
RULES = (("> 0", lambda v: v > 0, ("prompts", "length", "steps", "sampled_steps", "seeds", "eval_every", "beta",
                                    "lr", "sampled_lr", "q_min")),
         (">= 2", lambda v: v >= 2, ("vocab", "group_size")), (">= 0", lambda v: v >= 0, ("gamma", "token_gamma")),
         (">= 1", lambda v: v >= 1, ("q_max",)), ("<= 1", lambda v: v <= 1, ("q_min",)))


def parse(argv: list[str]) -> tuple[Path, Options]:
    parser = _Parser(prog="sage-study --toy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for toy.json and the plots")
    for name, value in asdict(Options()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    out, opts = Path(args.pop("out")), Options(**args)
    for rule, holds, names in RULES:
        for name in names:
            value = getattr(opts, name)
            if not holds(value):
                raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {value}")
    if opts.vocab**opts.length > 4096:
        raise ValueError(f"--vocab ** --length must be <= 4096 to enumerate, got {opts.vocab**opts.length}")
    return out, opts


def main(argv: list[str] | None = None) -> int:
    """`python -m sage_train.toy --out DIR [--steps N] [--seeds N] ...`; returns the exit status."""
    try:
        out, opts = parse(sys.argv[1:] if argv is None else argv)
    except ValueError as error:
        print(f"sage-study --toy: {error}")
        return 2
    except SystemExit as done:  # --help
        return int(done.code or 0)
    # The tables are tiny: a second thread only adds synchronisation (about 15x slower on a busy machine).
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    result = run(opts)
    result["command"] = "python -m sage_train.toy " + " ".join(sys.argv[1:] if argv is None else argv)
    result["files"] = ["toy.json", "curves.json"] + plot(result, out)
    # The curves are most of the numbers: one compact line each, apart from the readable report.
    lines = ",\n".join(f"{json.dumps(key)}: {json.dumps(curve)}" for key, curve in result.pop("curves").items())
    (out / "curves.json").write_text("{\n" + lines + "\n}\n")
    (out / "toy.json").write_text(json.dumps(result, indent=1) + "\n")
    cmp = {way: f"{c['max_abs_pass_at_k_difference']:.2e}" for way, c in result["branch_vs_grpo"].items()}
    print(f"tv_exact_objective {result['tv_exact_objective']:.2e}  tv_kl_only_surrogate "
          f"{result['tv_kl_only_surrogate']:.2e}\nsage-branch vs grpo, max |pass@k difference| {cmp}\n"
          f"wrote {out / 'toy.json'} in {result['wall_seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
