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
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from sage_kernels import LossConfig, fused_linear_sage_loss
from sage_train.advantages import group_advantages
from sage_train.tasks import enumerable as E

ALGORITHMS = ("grpo", "sage-branch", "sage-token")
BACKEND = "reference"  # float64 and materialised logits: exact, and the tables are tiny
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
        clamp = {"q_min": opts.q_min, "q_max": opts.q_max}
        self.token_log_q = E.token_log_q(task.ref_logits, gamma=opts.token_gamma, tau=opts.token_tau, **clamp)
        # The anchors held fixed for J: the branch guide as the first step computes it (at pi_ref).
        branch = E.branch_log_q(task.ref_logits, gamma=opts.gamma, tau=opts.tau, **clamp)
        self.fixed_log_q = {"grpo": None, "sage-branch": branch, "sage-token": self.token_log_q}
        self.optimum = {a: E.optimum(task, self.fixed_log_q[a], opts.beta) for a in ALGORITHMS}
        self.anchor = {a: E.task_logprobs(task, task.ref_logits, self.fixed_log_q[a]) for a in ALGORITHMS}
        self.ref_seq = self.anchor["grpo"]
        self.full_prompts = torch.arange(P).repeat_interleave(S)
        self.full_seqs = torch.arange(S).repeat(P)

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

    def report(self, seq: torch.Tensor, algorithm: str) -> dict:
        targets = {"optimum": self.optimum[algorithm], "grpo_optimum": self.optimum["grpo"]}
        return E.policy_report(self.task, seq, **targets, log_q=self.fixed_log_q[algorithm], beta=self.opts.beta, ks=KS)


# ----------------------------------------------------------------------------- the three ways


def exact_step(toy: Toy, theta: torch.Tensor, algorithm: str, full) -> None:
    """(a): theta.grad = -grad J (averaged over prompts), through the loss with beta 0."""
    hidden, tokens, _, _, _ = full
    seq = toy.seq_logp(theta)
    value = toy.task.reward - toy.opts.beta * (seq - toy.anchor[algorithm])
    advantage = (value - (seq.exp() * value).sum(-1, keepdim=True)).reshape(-1)
    # The loss averages rows and positions (1 / (P S L)); weights S L pi(x) make it E_pi per prompt.
    weights = (toy.task.sequences * toy.task.length * seq.exp()).reshape(-1, 1).expand_as(tokens)
    toy.loss("grpo", 0.0, hidden, theta, tokens, advantage, is_weights=weights).loss.backward()


def expected_step(toy: Toy, theta: torch.Tensor, algorithm: str, full, zero_advantages: bool = False) -> float:
    """(b): theta.grad = E_pi[gradient of the trainer's loss], every sequence weighted by pi(x).
    Returns the fraction of positions where q != 1, weighted by pi."""
    hidden, tokens, cols, ref_logp, token_q = full
    task, V = toy.task, toy.task.vocab
    seq = toy.seq_logp(theta)
    advantage = torch.zeros_like(seq) if zero_advantages else E.population_advantages(task, seq)
    hidden = hidden.clone().requires_grad_(True)
    weight = torch.cat([theta.detach(), torch.eye(V, dtype=E.DTYPE)], dim=1)
    out = toy.loss(algorithm, toy.opts.beta, hidden, weight, tokens, advantage.reshape(-1), token_q, ref_logp=ref_logp)
    (grad_hidden,) = torch.autograd.grad(out.loss, hidden)
    # Each row's logit gradient carries 1 / (P S L); S pi(x) turns the row mean into E_pi per prompt.
    row_weight = (task.sequences * seq.exp()).reshape(-1, 1, 1)
    per_row = (grad_hidden[..., toy.dim :] * row_weight).reshape(-1, V)
    theta.grad = torch.zeros(toy.dim, V, dtype=E.DTYPE).index_add_(0, cols.reshape(-1), per_row).t()
    prob = seq.exp().reshape(-1, 1)
    return float((prob * (out.q != 1.0)).sum() / (prob.sum() * task.length))


def sampled_step(toy: Toy, theta: torch.Tensor, algorithm: str, generator: torch.Generator) -> None:
    """(c): G samples per prompt, group-normalised advantages, one on-policy step."""
    task, G = toy.task, toy.opts.group_size
    draws = torch.multinomial(toy.seq_logp(theta).exp(), G, replacement=True, generator=generator)
    advantage = group_advantages(task.reward.gather(1, draws)).reshape(-1)
    hidden, tokens, _, ref_logp, token_q = toy.rows(torch.arange(task.prompts).repeat_interleave(G), draws.reshape(-1))
    out = toy.loss(algorithm, toy.opts.beta, hidden, theta, tokens, advantage, token_q, ref_logp=ref_logp)
    out.loss.backward()


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
    rate = (lambda i: 1.0) if sampled else (lambda i: 0.5 * (1 + math.cos(math.pi * i / steps)))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
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
    task, ref_theta = toy.task, table_of(toy.task.ref_logits)
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

    def done(way: str, a: str, text: str) -> None:
        log(f"({way}) {a:12s} {text}  [{time.perf_counter() - start:.0f}s]")

    curves, ends = {}, {}
    for a in ALGORITHMS:
        step = partial(exact_step, toy, algorithm=a, full=full)
        theta, curves["exact", a], _ = train(toy, step, ref_theta, toy.optimum[a])
        result.setdefault("exact", {})[a] = toy.report(toy.seq_logp(theta), a)
        done("exact", a, f"tv to pi* {result['exact'][a]['tv_to_optimum']:.2e}")
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

    sampled_end = {a: [] for a in ALGORITHMS}
    for a in ALGORITHMS:
        for seed in range(opts.seeds):
            generator = torch.Generator().manual_seed(1000 + seed)  # the same seeds for every algorithm
            step = partial(sampled_step, toy, algorithm=a, generator=generator)
            theta, curves["sampled", a, seed], settled = train(toy, step, ref_theta, toy.optimum[a], sampled=True)
            sampled_end[a].append((toy.seq_logp(theta), settled))
        result.setdefault("sampled", {})[a] = sampled_report(toy, a, sampled_end[a], ends[a])
        text = "tv to pi* {tv_to_optimum:.4f}, to (b) {tv_to_expected:.4f}, 2nd half {settled_tv_to_expected:.4f}"
        done("sampled", a, text.format(**result["sampled"][a]))

    result["tv_exact_objective"] = max(result["exact"][a]["tv_to_optimum"] for a in ALGORITHMS)
    result["tv_kl_only_surrogate"] = max(result["kl_only"][a]["tv_to_fixed_point"] for a in ALGORITHMS)
    result["branch_vs_grpo"] = compare(result, ends, sampled_end)
    result["curves"] = {" ".join(map(str, key)): curve for key, curve in curves.items()}
    result["wall_seconds"] = time.perf_counter() - start
    return result


def mean(values):
    """Mean over seeds of numbers, or elementwise of equal-length lists."""
    return [sum(c) / len(c) for c in zip(*values)] if isinstance(values[0], list) else sum(values) / len(values)


def sampled_report(toy: Toy, algorithm: str, ends: list, expected_end: torch.Tensor) -> dict:
    """(c) per seed and averaged over seeds: the final table and the second-half average (`settled`)."""
    optimum, runs = toy.optimum[algorithm], []
    for seq, settled in ends:
        runs.append(toy.report(seq, algorithm))
        runs[-1]["tv_to_expected"] = float(E.tv(seq, expected_end).mean())
        runs[-1]["settled_tv_to_optimum"] = float(E.tv(settled, optimum).mean())
        runs[-1]["settled_tv_to_expected"] = float(E.tv(settled, expected_end).mean())
        runs[-1]["settled_pass_at_k"] = E.pass_at_k(toy.task, settled, KS).mean(0).tolist()
    return {"per_seed": runs, **{key: mean([r[key] for r in runs]) for key in runs[0]}}


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
    pairs = [(j, k) for j in seeds for k in seeds if j != k]
    for i, name in enumerate(("final", "settled")):
        for a, label in (("sage-branch", "branch"), ("grpo", "grpo")):
            tvs = [float(E.tv(sampled_end[a][j][i], sampled_end["grpo"][k][i]).mean()) for j, k in pairs]
            out["sampled"][f"tv_{name}_{label}_to_grpo_seeds"] = mean(tvs) if tvs else None
    per_seed = [result["sampled"][a]["per_seed"] for a in ("sage-branch", "grpo")]
    out["sampled"]["pass_at_1_paired_gaps"] = [b["pass_at_k"][0] - g["pass_at_k"][0] for b, g in zip(*per_seed)]
    return out


def plot(result: dict, out: Path) -> list[str]:
    """tv_curves.png (TV to the target along training, per way) and pass_at_k.png (exact curves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"grpo": "tab:blue", "sage-branch": "tab:red", "sage-token": "tab:green"}
    titles = {"exact": "(a) exact gradient of J", "expected": "(b) the loss in expectation"}
    titles.update(kl_only="(b) zero advantages, to q pi_ref / Z_t", sampled="(c) sampled, G per prompt")
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6), sharey=True)
    for ax, way in zip(axes, titles):
        for key, curve in result["curves"].items():
            parts = key.split(" ")
            label = parts[1] if len(parts) == 2 or parts[2] == "0" else None
            if parts[0] == way:
                ax.plot(*zip(*curve), color=colours[parts[1]], alpha=0.5 if way == "sampled" else 1.0, label=label)
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
            pass_at_k = result[way][a]["pass_at_k"]
            ax.plot(result["ks"], pass_at_k, color=colours[a], linestyle=style, marker=".", label=f"{way} {a}")
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
RULES = (
    (
        "> 0",
        lambda v: v > 0,
        ("prompts", "length", "steps", "sampled_steps", "seeds", "eval_every", "beta", "lr", "sampled_lr", "q_min"),
    ),
    (">= 2", lambda v: v >= 2, ("vocab", "group_size")),
    (">= 0", lambda v: v >= 0, ("gamma", "token_gamma")),
    (">= 1", lambda v: v >= 1, ("q_max",)),
    ("<= 1", lambda v: v <= 1, ("q_min",)),
)


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
    print(
        f"tv_exact_objective {result['tv_exact_objective']:.2e}  tv_kl_only_surrogate "
        f"{result['tv_kl_only_surrogate']:.2e}\nsage-branch vs grpo, max |pass@k difference| {cmp}\n"
        f"wrote {out / 'toy.json'} in {result['wall_seconds']:.0f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
