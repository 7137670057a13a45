"""The enumerable toy: its exact quantities against brute-force sums, and the three training ways.

A smaller instance than the report's (2 prompts, V = 3, L = 3: 27 sequences per prompt)."""

from __future__ import annotations

import itertools
import json
import math
from functools import partial

import pytest
import torch

from sage_train import toy as T
from sage_train.tasks import enumerable as E

SMALL = T.Options(
    prompts=2, vocab=3, length=3, task_seed=3, token_gamma=1.0, steps=300, sampled_steps=20, seeds=1, eval_every=50
)


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
    ]
    assert T.main(argv) == 0
    report = json.loads((tmp_path / "toy.json").read_text())
    assert report["tv_exact_objective"] <= 0.01
    assert report["tv_kl_only_surrogate"] <= 0.01
    for way in ("exact", "expected", "sampled"):
        for algorithm in T.ALGORITHMS:
            assert 0 <= report[way][algorithm]["tv_to_optimum"] <= 1
            assert len(report[way][algorithm]["pass_at_k"]) == len(T.KS)
    assert len(report["sampled"]["grpo"]["per_seed"]) == 2
    assert all((tmp_path / name).stat().st_size > 0 for name in report["files"])
    curves = json.loads((tmp_path / "curves.json").read_text())
    assert curves["exact grpo"][0] == [0, pytest.approx(report["optimum"]["grpo"]["tv_to_reference"])]


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "5"],
        ["--out", "x", "--steps", "0"],
        ["--out", "x", "--vocab", "1"],
        ["--out", "x", "--length", "9"],
        ["--out", "x", "--bogus", "1"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    assert T.main(argv) == 2
    assert len(capsys.readouterr().out.strip().splitlines()) == 1


def test_help_exits_0_and_names_the_options(capsys):
    assert T.main(["--help"]) == 0
    assert "--sampled-steps" in capsys.readouterr().out
