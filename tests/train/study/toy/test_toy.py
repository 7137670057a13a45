"""The enumerable toy: its exact quantities against brute-force sums, the training ways, the
self-consistent optimum, ``kl_in_reward`` reaching the objective's optima, and the coverage toy.

A smaller instance than the report's (2 prompts, V = 3, L = 3: 27 sequences per prompt)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from functools import partial

import pytest
import torch

from sage_train.rl_maths import sequence_kl
from sage_train.study.toy import command
from sage_train.study.toy import coverage as C
from sage_train.study.toy import enumerable as E
from sage_train.study.toy import tabular as T

SMALL = T.Options(
    prompts=2, vocab=3, length=3, task_seed=3, token_gamma=1.0, steps=300, sampled_steps=20, seeds=1, eval_every=50
)
#: a branch guide active enough that its self-consistent optimum is 0.054 (TV) from its pi* at pi_ref;
#: groups of 32 find the rare answers within a few hundred steps (600 steps end within 0.005 of the target)
GUIDED = dataclasses.replace(SMALL, gamma=2.0, tau=0.3, sampled_steps=600, group_size=32)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def toy():
    return T.Toy(SMALL)


def brute_sequence_probs(logits: torch.Tensor, vocab: int, length: int, log_q=None) -> dict:
    """{(p, x): pi(x) * prod q} by walking each sequence's prefixes, with a prefix -> node map built here."""
    node_of = {
        prefix: i
        for i, prefix in enumerate(
            prefix for t in range(length) for prefix in itertools.product(range(vocab), repeat=t)
        )
    }
    probs = {}
    for p in range(logits.shape[0]):
        for x in itertools.product(range(vocab), repeat=length):
            value = 1.0
            for t in range(length):
                node = node_of[x[:t]]
                value *= float(torch.softmax(logits[p, node], -1)[x[t]])
                if log_q is not None:
                    value *= math.exp(float(log_q[p, node, x[t]]))
            probs[p, x] = value
    return probs


def test_prefix_tree_numbers_prefixes_by_depth_then_lexicographically():
    tokens, nodes = E.prefix_tree(3, 3)
    expected = {
        prefix: i
        for i, prefix in enumerate(prefix for t in range(3) for prefix in itertools.product(range(3), repeat=t))
    }
    for x, row in zip(tokens.tolist(), nodes.tolist()):
        assert row == [expected[tuple(x[:t])] for t in range(3)]


def test_sequence_probabilities_match_walking_the_tree(toy):
    task = toy.task
    brute = brute_sequence_probs(task.ref_logits, 3, 3, toy.token_log_q)
    seq = E.task_logprobs(task, task.ref_logits, toy.token_log_q).exp()
    for (p, x), value in brute.items():
        assert seq[p, task.tokens.tolist().index(list(x))].item() == pytest.approx(value, rel=1e-12)
    assert E.task_logprobs(task, task.ref_logits).exp().sum(-1).tolist() == pytest.approx([1.0, 1.0], abs=1e-12)


def test_pass_at_k_counts_every_k_tuple_with_a_correct_draw(toy):
    task = toy.task
    seq = E.task_logprobs(task, task.ref_logits)
    exact = E.pass_at_k(task, seq, [1, 2, 3])
    prob, reward = seq.exp(), task.reward
    for p in range(task.prompts):
        for j, k in enumerate([1, 2, 3]):
            hit = sum(
                math.prod(prob[p, i].item() for i in draw)
                for draw in itertools.product(range(task.sequences), repeat=k)
                if any(reward[p, i] > 0 for i in draw)
            )
            assert exact[p, j].item() == pytest.approx(hit, rel=1e-10)


def test_objective_kl_and_optimum_match_direct_sums(toy):
    task, beta = toy.task, SMALL.beta
    log_q = toy.fixed_log_q["sage-branch"]
    pi = brute_sequence_probs(task.ref_logits + 0.7, 3, 3)  # a shift leaves pi = pi_ref per node
    anchor = brute_sequence_probs(task.ref_logits, 3, 3, log_q)
    seq = E.task_logprobs(task, task.ref_logits)
    index = {tuple(x): i for i, x in enumerate(task.tokens.tolist())}
    for p in range(task.prompts):
        reward = {x: task.reward[p, i].item() for x, i in index.items()}
        kl_q = sum(pi[p, x] * math.log(pi[p, x] / anchor[p, x]) for x in index)
        j = sum(pi[p, x] * reward[x] for x in index) - beta * kl_q
        assert E.objective(task, seq, log_q, beta)[p].item() == pytest.approx(j, rel=1e-10)
        # max J = beta log sum_x Q(x) exp(r / beta), attained at pi*
        best = beta * math.log(sum(anchor[p, x] * math.exp(reward[x] / beta) for x in index))
        assert E.objective(task, toy.optimum["sage-branch"], log_q, beta)[p].item() == pytest.approx(best, rel=1e-10)
    assert E.kl(seq, seq).abs().max().item() < 1e-12
    star = toy.optimum["sage-branch"]
    assert E.kl(star, seq).min().item() > 0.01


def test_optimum_beats_nearby_policies(toy):
    task, beta, log_q = toy.task, SMALL.beta, toy.fixed_log_q["sage-token"]
    star = toy.optimum["sage-token"]
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        nearby = torch.log_softmax(star + 0.1 * torch.randn(star.shape, generator=generator, dtype=E.DTYPE), -1)
        assert (E.objective(task, nearby, log_q, beta) < E.objective(task, star, log_q, beta)).all()


def test_exact_step_is_minus_the_gradient_of_j(toy):
    task = toy.task
    full = toy.rows(toy.full_prompts, toy.full_seqs)
    theta = (T.table_of(task.ref_logits) + 0.3).requires_grad_(True)
    T.exact_step(toy, theta, "sage-branch", full)
    direct = T.table_of(task.ref_logits).add(0.3).requires_grad_(True)
    seq = E.task_logprobs(task, direct.t().reshape(task.prompts, task.num_nodes, task.vocab))
    (-E.objective(task, seq, toy.fixed_log_q["sage-branch"], SMALL.beta).mean()).backward()
    torch.testing.assert_close(theta.grad, direct.grad, rtol=1e-10, atol=1e-14)


def test_k3_expected_gradient_is_z_pi_minus_q_pi_ref_per_node(toy):
    task = toy.task
    full = toy.rows(toy.full_prompts, toy.full_seqs, extra=task.vocab)
    generator = torch.Generator().manual_seed(1)
    theta = T.table_of(task.ref_logits + torch.randn(task.ref_logits.shape, generator=generator, dtype=E.DTYPE))
    theta.requires_grad_(True)
    T.expected_step(toy, theta, "sage-token", full, zero_advantages=True)
    pi = torch.softmax(toy.logits(theta), -1)
    q_ref = toy.token_log_q.exp() * torch.softmax(task.ref_logits, -1)
    reach = E.visitation(task, toy.seq_logp(theta))[..., None]
    expected = reach * SMALL.beta / task.length * (q_ref.sum(-1, keepdim=True) * pi - q_ref) / task.prompts
    torch.testing.assert_close(theta.grad, T.table_of(expected), rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("algorithm", T.ALGORITHMS)
def test_exact_gradient_reaches_the_optimum(toy, algorithm):
    full = toy.rows(toy.full_prompts, toy.full_seqs)
    start = T.table_of(toy.task.ref_logits)
    step = partial(T.exact_step, toy, algorithm=algorithm, full=full)
    theta, curve, _ = T.train(toy, step, start, toy.optimum[algorithm])
    assert curve[0][1] > 0.1
    assert E.tv(toy.seq_logp(theta), toy.optimum[algorithm]).mean().item() <= 0.01


@pytest.mark.parametrize("algorithm", ["sage-branch", "sage-token"])
def test_k3_alone_reaches_the_per_position_fixed_point(toy, algorithm):
    task = toy.task
    full = toy.rows(toy.full_prompts, toy.full_seqs, extra=task.vocab)
    fixed = E.task_logprobs(task, E.surrogate_fixed_point(task, toy.token_log_q if algorithm == "sage-token" else None))
    start = T.table_of(task.ref_logits)
    if algorithm == "sage-branch":  # its fixed point is pi_ref itself: start elsewhere
        start = start + torch.randn(start.shape, generator=torch.Generator().manual_seed(2), dtype=E.DTYPE)
    step = partial(T.expected_step, toy, algorithm=algorithm, full=full, zero_advantages=True)
    theta, curve, _ = T.train(toy, step, start, fixed)
    assert curve[0][1] > 0.05
    assert E.tv(toy.seq_logp(theta), fixed).mean().item() <= 0.01


def test_main_writes_the_report(tmp_path):
    argv = [
        "--out",
        str(tmp_path),
        "--prompts",
        "2",
        "--vocab",
        "3",
        "--length",
        "3",
        "--steps",
        "150",
        "--sampled-steps",
        "10",
        "--seeds",
        "2",
        "--eval-every",
        "50",
        "--coverage",
        "4",
    ]
    assert command.main(argv) == 0
    report = json.loads((tmp_path / "toy.json").read_text())
    assert report["tv_exact_objective"] <= 0.01
    assert report["tv_reward_expected"] <= 0.01
    assert report["tv_kl_only_surrogate"] <= 0.01
    for way in ("exact", "expected", "sampled", "reward_expected", "reward_sampled", "self_consistent"):
        for algorithm in T.ALGORITHMS:
            assert 0 <= report[way][algorithm]["tv_to_optimum"] <= 1
            assert len(report[way][algorithm]["pass_at_k"]) == len(T.KS)
    assert len(report["sampled"]["grpo"]["per_seed"]) == 2
    assert all((tmp_path / name).stat().st_size > 0 for name in report["files"])
    curves = json.loads((tmp_path / "curves.json").read_text())
    assert curves["exact grpo"][0] == [0, pytest.approx(report["optimum"]["grpo"]["tv_to_reference"])]
    coverage = json.loads((tmp_path / "coverage.json").read_text())
    assert coverage["options"]["prompts"] == 4 and coverage["options"]["hard"] == 1
    assert list(coverage["arms"]) == [arm.name for arm in C.arms(C.coverage_options(T.Options()))]
    assert all(len(arm["pass_at_k"]) == len(T.KS) for arm in coverage["arms"].values())
    assert all((tmp_path / name).stat().st_size > 0 for name in coverage["files"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "5"],
        ["--out", "x", "--steps", "0"],
        ["--out", "x", "--vocab", "1"],
        ["--out", "x", "--length", "9"],
        ["--out", "x", "--bogus", "1"],
        ["--out", "x", "--coverage", "-1"],
        ["--out", "x", "--hard", "4"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    assert command.main(argv) == 2
    assert len(capsys.readouterr().out.strip().splitlines()) == 1


def test_help_exits_0_and_names_the_options(capsys):
    assert command.main(["--help"]) == 0
    assert "--sampled-steps" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the self-consistent optimum


def test_node_log_probs_recover_the_table(toy):
    task = toy.task
    logits = task.ref_logits + torch.randn(
        task.ref_logits.shape, generator=torch.Generator().manual_seed(5), dtype=E.DTYPE
    )
    table = E.node_log_probs(task, E.task_logprobs(task, logits))
    torch.testing.assert_close(table, torch.log_softmax(logits, -1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("algorithm", ["sage-branch", "sage-token"])
def test_self_consistent_optimum_is_the_optimum_of_its_own_guide(algorithm):
    toy = T.Toy(GUIDED)
    consistent, (iterations, move) = toy.consistent[algorithm], toy.iterations[algorithm]
    assert move < 1e-11 and iterations > 1
    own_guide = toy.guide_log_q(algorithm, E.node_log_probs(toy.task, consistent))
    again = E.optimum(toy.task, own_guide, GUIDED.beta)
    assert E.tv(again, consistent).max().item() < 1e-10
    # and it is not the optimum of the guide at pi_ref
    assert E.tv(consistent, toy.optimum[algorithm]).mean().item() > 0.02


# ----------------------------------------------------------------------------- kl_in_reward


@pytest.fixture(scope="module")
def guided():
    return T.Toy(GUIDED)


def test_the_reward_kl_of_a_completion_is_log_pi_over_q(guided):
    """What the trainer's `sequence_kl` sums per token is log pi(x) - log Q(x) of the whole sequence."""
    task, toy = guided.task, guided
    logits = task.ref_logits + 0.4
    seq = E.task_logprobs(task, logits)
    log_q = toy.guide_log_q("sage-branch", logits)
    prompts, at = toy.full_prompts, (toy.full_prompts[:, None], task.nodes[toy.full_seqs], task.tokens[toy.full_seqs])
    old_logp = torch.log_softmax(logits, -1)[at]
    kl = sequence_kl(old_logp, toy.ref_table[at], log_q[at], torch.ones_like(old_logp, dtype=torch.bool))
    anchor = E.task_logprobs(task, task.ref_logits, log_q)
    torch.testing.assert_close(kl, (seq - anchor)[prompts, toy.full_seqs], rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ["frozen", "recomputed"])
def test_kl_in_reward_in_expectation_reaches_its_optimum(guided, mode):
    """q at pi_ref: pi*; q from the current policy: the self-consistent optimum; each within 0.01."""
    target = guided.optimum if mode == "frozen" else guided.consistent
    other = guided.consistent if mode == "frozen" else guided.optimum
    full = guided.rows(guided.full_prompts, guided.full_seqs)
    step = partial(T.exact_step, guided, algorithm="sage-branch", full=full, reward_kl=mode)
    theta, curve, _ = T.train(guided, step, guided.start(), target["sage-branch"])
    end = guided.seq_logp(theta)
    assert curve[0][1] > 0.1
    assert E.tv(end, target["sage-branch"]).mean().item() <= 0.01
    assert E.tv(end, other["sage-branch"]).mean().item() > 0.04


@pytest.mark.parametrize("mode", ["frozen", "recomputed"])
def test_sampled_kl_in_reward_reaches_its_optimum(guided, mode):
    """G completions per prompt, the trainer's `advantages_of_j` with an unscaled task part (J's
    gradient times (G - 1) / G): within 0.05."""
    target = (guided.optimum if mode == "frozen" else guided.consistent)["sage-branch"]
    generator = torch.Generator().manual_seed(1000)
    step = partial(T.sampled_step, guided, algorithm="sage-branch", generator=generator, reward_kl=mode, scale=False)
    theta, curve, _ = T.train(guided, step, guided.start(), target, sampled=True)
    assert curve[0][1] > 0.1
    assert E.tv(guided.seq_logp(theta), target).mean().item() <= 0.05


# ----------------------------------------------------------------------------- the shared policy


def test_shared_exact_step_is_minus_the_gradient_of_j():
    """With one table shared by the prompts (the coverage toy), the loss's gradient is still -grad J."""
    toy = T.Toy(dataclasses.replace(SMALL, prompts=4, hard=1, shared=True))
    full = toy.rows(toy.full_prompts, toy.full_seqs)
    shift = 0.3 * torch.randn(toy.start().shape, generator=torch.Generator().manual_seed(6), dtype=E.DTYPE)
    theta = (toy.start() + shift).requires_grad_(True)
    T.exact_step(toy, theta, "sage-branch", full)
    direct = (toy.start() + shift).requires_grad_(True)
    seq = E.task_logprobs(toy.task, toy.task.ref_logits + direct.t()[None])
    (-E.objective(toy.task, seq, toy.fixed_log_q["sage-branch"], SMALL.beta).mean()).backward()
    torch.testing.assert_close(theta.grad, direct.grad, rtol=1e-10, atol=1e-14)
    assert theta.grad.shape == (3, toy.task.num_nodes)


def test_shared_task_gives_the_easy_prompts_one_common_answer():
    task = E.make_task(6, 3, 3, seed=2, hard=2, spread=0.5)
    common = task.reward[:4].prod(0)  # rewarded in every easy prompt
    assert common.sum() == 1 and (task.reward[4:] * common).sum() == 0
    assert task.reward.sum(-1).tolist() == [3.0, 3.0, 3.0, 3.0, 2.0, 2.0]


# ----------------------------------------------------------------------------- the KL estimators in expectation


def expected_kl_gradient(logits, ref_logp, kl: str, guide: str, log_q=None, **options):
    """sum_y pi(y) * d(beta kl at token y)/d logits at one prefix, on-policy, advantages 0, beta 1."""
    from sage_kernels import LossConfig, fused_linear_sage_loss

    V, total = logits.shape[0], torch.zeros_like(logits)
    pi = torch.softmax(logits, -1)
    config = LossConfig(beta=1.0, kl=kl, guide=guide, gamma=1.0, tau=0.5, **options)
    for y in range(V):
        weight = logits[:, None].clone().requires_grad_(True)
        inputs = {"ref_logp": ref_logp[y].view(1, 1), "log_q": None if log_q is None else log_q[y].view(1, 1)}
        out = fused_linear_sage_loss(
            torch.ones(1, 1, 1, dtype=E.DTYPE),
            weight,
            torch.tensor([[y]]),
            torch.ones(1, 1, dtype=torch.bool),
            torch.zeros(1, dtype=E.DTYPE),
            config=config,
            backend="reference",
            **inputs,
        )
        out.loss.backward()
        total += pi[y] * weight.grad[:, 0]
    return total


def test_k1_has_no_expected_gradient_and_k2_ignores_a_position_only_guide():
    """docs/loss.md: on-policy, E[grad k1] = 0 whatever the guide (with the ratio correction: the
    reverse KL's, as k2's); k2 with the branch guide (one q for every token of the prefix) has k2's
    expected gradient without it; k3's is scaled by that q."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(5, generator=generator, dtype=E.DTYPE)
    ref_logp = torch.log_softmax(torch.randn(5, generator=generator, dtype=E.DTYPE), -1)
    token_q = 0.3 * torch.randn(5, generator=generator, dtype=E.DTYPE)
    assert E.node_entropy(logits[None]).item() > 0.6  # above tau: the branch guide's q > 1 here
    for guide, log_q in (("none", None), ("branch", None), ("none", token_q)):
        assert expected_kl_gradient(logits, ref_logp, "k1", guide, log_q).abs().max().item() < 1e-14
    k2, k2_branch = (expected_kl_gradient(logits, ref_logp, "k2", guide) for guide in ("none", "branch"))
    torch.testing.assert_close(k2_branch, k2, rtol=1e-12, atol=1e-14)
    assert k2.abs().max().item() > 0.01
    # k1 times the ratio: the reverse KL's gradient, k2's
    corrected = expected_kl_gradient(logits, ref_logp, "k1", "none", use_bias_correction_kl=True)
    torch.testing.assert_close(corrected, k2, rtol=1e-10, atol=1e-14)
    k3, k3_branch = (expected_kl_gradient(logits, ref_logp, "k3", guide) for guide in ("none", "branch"))
    q = 1.0 + (E.node_entropy(logits[None]).item() - 0.5)
    torch.testing.assert_close(k3_branch, min(q, 1.4) * k3, rtol=1e-10, atol=1e-14)
