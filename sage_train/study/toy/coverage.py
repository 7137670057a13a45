"""The coverage toy: one policy table shared by many prompts, where sharpening costs coverage.

The tabular toy (`sage_train.study.toy.tabular`) gives every prompt its own table, so learning one prompt never
costs another and every trained policy keeps pi_ref's pass@k at large k. Here (`Options.shared`)
the prompts' pi_ref are alike (one base table, each prompt's own N(0, spread^2) logits added) and
the policy adds one table theta, the same for every prompt, to each prompt's pi_ref logits, as a
language model's weights serve every prompt. Most prompts have one common correct answer, the
same sequence for all of them (from the base table's top tenth), and two rare ones of their own;
the last `hard` have only their two rare ones. Raising the common answer raises it everywhere,
and what it takes comes partly from the rare answers of the prompts it does not solve.

Every arm trains exactly in expectation from pi_ref, with the package's loss (way (b) of
`sage_train.study.toy.tabular`: the trainer's loss, every sequence weighted by its probability, advantages
normalised under pi) or, for ``kl_in_reward``, way (d) (the KL to q pi_ref in the reward, q
recomputed from the current policy); beta is the trainer's 0.05. The arms are those of the
decisive study: grpo, grpo-beta1.4x (beta times q_max, docs/convergence.md), grpo-no-kl,
sage-branch at tau = the start's 80% entropy quantile and at the paper's 1.2, sage-branch-exact
at both, and grpo-kl-in-reward (SAGE's objective without a guide, the exact arms' baseline).

`python -m sage_train.study.toy.command --out DIR` runs it after the tabular toy with ``--coverage`` prompts (32;
0 skips it) and the tabular toy's vocabulary, length and steps, and writes DIR/coverage.json and
DIR/coverage_pass_at_k.png (docs/results/toy.md).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import partial

import torch

from . import enumerable as E
from .tabular import KS, Options, Toy, exact_step, expected_step, train

#: what the coverage toy changes in the tabular toy's options, beside its prompts (``--coverage``,
#: 32) of which a quarter are hard; beta is the trainer's
COVERAGE = {"shared": True, "spread": 0.5, "beta": 0.05}
COVERAGE_KS = KS  # up to 1024
ENTROPY_LEVEL = 0.8  # tau of the first branch arms: this quantile of the start's entropies
PAPER_TAU = 1.2


@dataclass(frozen=True)
class Arm:
    """One way of training: the guide (`Toy.guide_log_q`'s algorithm), the KL in the loss
    ("loss", way (b)) or in the reward ("reward", way (d)), beta's factor, and tau."""

    name: str
    algorithm: str
    way: str = "loss"
    beta_factor: float = 1.0
    tau: str = ""  # "q80", "1.2" or "" (the guide's default; unused without a branch guide)


def arms(opts: Options) -> tuple[Arm, ...]:
    return (
        Arm("grpo", "grpo"),
        Arm(f"grpo-beta{opts.q_max:g}x", "grpo", beta_factor=opts.q_max),
        Arm("grpo-no-kl", "grpo", beta_factor=0.0),
        Arm("sage-branch tau=q80", "sage-branch", tau="q80"),
        Arm("sage-branch tau=1.2", "sage-branch", tau="1.2"),
        Arm("grpo-kl-in-reward", "grpo", way="reward"),
        Arm("sage-branch-exact tau=q80", "sage-branch", way="reward", tau="q80"),
        Arm("sage-branch-exact tau=1.2", "sage-branch", way="reward", tau="1.2"),
    )


def coverage_options(opts: Options) -> Options:
    return dataclasses.replace(opts, prompts=opts.coverage, hard=opts.coverage // 4, **COVERAGE)


def describe_policy(toy: Toy, seq: torch.Tensor) -> dict:
    """Exact pass@k, P(correct) (per prompt, and the means of the easy and the hard prompts), KL and
    TV to pi_ref of a policy's sequence log-probs."""
    task, easy = toy.task, toy.task.prompts - toy.opts.hard  # the hard prompts are the last ones
    p_correct = (seq.exp() * task.reward).sum(-1)
    return {
        "pass_at_k": E.pass_at_k(task, seq, COVERAGE_KS).mean(0).tolist(),
        "p_correct": p_correct.tolist(),
        "p_correct_easy_mean": float(p_correct[:easy].mean()) if easy else None,
        "p_correct_hard_mean": float(p_correct[easy:].mean()) if easy < task.prompts else None,
        "kl_to_reference": float(E.kl(seq, toy.ref_seq).mean()),
        "tv_to_reference": float(E.tv(seq, toy.ref_seq).mean()),
    }


def run(opts: Options, log=print) -> dict:
    """Every arm of `arms` on the coverage toy; returns the report (coverage.json)."""
    start, base = time.perf_counter(), coverage_options(opts)
    toy = Toy(base)
    task, V = toy.task, toy.task.vocab
    taus = {"q80": E.entropy_quantile(task, task.ref_logits, ENTROPY_LEVEL), "1.2": PAPER_TAU}
    reference = describe_policy(toy, toy.ref_seq)
    result = {"options": dataclasses.asdict(base), "task": E.describe(task), "ks": list(COVERAGE_KS)}
    result.update(taus=taus, reference=reference, arms={})
    for arm in arms(base):
        arm_toy = Toy(dataclasses.replace(base, tau=taus[arm.tau])) if arm.tau else toy
        active = []
        if arm.way == "loss":
            full = arm_toy.rows(arm_toy.full_prompts, arm_toy.full_seqs, extra=V)
            beta = base.beta * arm.beta_factor

            def step(theta, arm_toy=arm_toy, full=full, beta=beta, algorithm=arm.algorithm):
                active.append(expected_step(arm_toy, theta, algorithm, full, beta=beta))

        else:
            full = arm_toy.rows(arm_toy.full_prompts, arm_toy.full_seqs)
            step = partial(exact_step, arm_toy, algorithm=arm.algorithm, full=full, reward_kl="recomputed")
        theta, curve, settled = train(arm_toy, step, arm_toy.start(), toy.ref_seq)
        seq = arm_toy.seq_logp(theta)
        report = describe_policy(toy, seq)
        report["pass_at_k_minus_reference"] = [a - r for a, r in zip(report["pass_at_k"], reference["pass_at_k"])]
        easy = base.prompts - base.hard
        report["hard_prompts_below_reference"] = sum(
            a < r for a, r in zip(report["p_correct"][easy:], reference["p_correct"][easy:])
        )
        # how far the last half of training still moved it (0 at a fixed point)
        report["tv_to_second_half_mean"] = float(E.tv(seq, settled).mean())
        report["tv_curve_from_reference"] = curve
        if arm.tau:
            report["tau"] = taus[arm.tau]
        if active:
            report["guided_fraction_first_last"] = [active[0], active[-1]]
        result["arms"][arm.name] = report
        gaps = report["pass_at_k_minus_reference"]
        log(
            f"(coverage) {arm.name:26s} pass@1 {report['pass_at_k'][0]:.3f} ({gaps[0]:+.3f}), "
            f"pass@1024 {report['pass_at_k'][-1]:.3f} ({gaps[-1]:+.3f})  [{time.perf_counter() - start:.0f}s]"
        )
    result["wall_seconds"] = time.perf_counter() - start
    return result
