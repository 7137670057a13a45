"""math_reward: real math-verify grading of the shared benchmark golds, a hard time limit that
holds against work stuck in sympy, and calls from threads other than the main one."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from sage_train.tasks.grading import GradingPool, grading_stats, math_reward, math_rewards

# How models write a final answer: a box inside prose, with text after it.
STYLES = (
    "Let's think step by step. First, 2 + 3 = 5.\nTherefore, the final answer is $\\boxed{{{}}}$. "
    "I hope it is correct.",
    "We simplify the expression and check the cases.\n\n**Final Answer**\n\\[\n\\boxed{{{}}}\n\\]\n"
    "This completes the solution.",
    "Setting x = 1 gives 7, which is too large, so the answer is \\boxed{{{}}}, as claimed above.",
)


def written(gold: str, i: int) -> str:
    return STYLES[i % len(STYLES)].format(gold)


def same_answer_text(a: str, b: str) -> bool:
    """Two golds that are the same answer by plain text or number: a shuffle pairing them is
    not a wrong answer. Deliberately independent of math-verify."""
    strip = lambda s: re.sub(r"\s+|\\[!,; ]|^\\text\{(.*)\}$", r"\1", s)  # noqa: E731
    a, b = strip(a), strip(b)
    if a == b:
        return True
    try:
        return float(a.replace(",", "")) == float(b.replace(",", ""))
    except ValueError:
        return False


def test_golds_written_like_models_grade_correct(gold_answers):
    scores = math_rewards((written(gold, i), gold) for i, (_, gold) in enumerate(gold_answers))
    wrong = [(name, gold) for (name, gold), s in zip(gold_answers, scores) if s != 1.0]
    assert wrong == []
    assert {name for name, _ in gold_answers} == {"math500", "aime24", "aime25", "amc23", "minerva"}
    assert len(gold_answers) == 500 + 30 + 30 + 40 + 272


def test_shuffled_golds_grade_wrong(gold_answers):
    golds = [gold for _, gold in gold_answers]
    order = list(range(len(golds)))
    random.Random(0).shuffle(order)
    # Every third problem (all five files represented): a wrong answer costs sympy more than a
    # right one, and a third keeps this test under ten seconds on two cores.
    sample = range(0, len(golds), 3)
    assert {gold_answers[i][0] for i in sample} == {name for name, _ in gold_answers}
    pairs = [(i, order[i]) for i in sample if not same_answer_text(golds[i], golds[order[i]])]
    # Small integers recur across problems ("3" is the gold of 24): pairings of the same answer
    # are excluded by text alone; with this seed there are exactly five ("4"/"4" thrice, "2"/"2"
    # twice). Every other pairing must grade wrong.
    assert len(sample) - len(pairs) == 5
    scores = math_rewards((written(golds[j], i), golds[i]) for i, j in pairs)
    graded_right = [(golds[i], golds[j]) for (i, j), s in zip(pairs, scores) if s != 0.0]
    assert graded_right == []


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("so x = \\boxed{2\\sqrt{3}} and we are done", "\\sqrt{12}", 1.0),
        ("\\boxed{(1, 2)}", "(1,2)", 1.0),
        ("\\boxed{3} ... on second thought \\boxed{4}", "4", 1.0),  # the last box counts
        ("\\boxed{4} ... on second thought \\boxed{3}", "4", 0.0),
        ("\\boxed{5}", "4", 0.0),
        ("no answer here", "4", 0.0),
        ("", "4", 0.0),
        ("\\boxed{4}", "", 0.0),
    ],
)
def test_single_answers(completion, gold, expected):
    assert math_reward(completion, gold) == expected


def test_pathological_answer_times_out_and_the_pool_recovers():
    pool = GradingPool(processes=1, timeout_s=1.0)
    try:
        pool.grade([("\\boxed{1}", "1")])  # the worker is up before the clock starts
        start = time.monotonic()
        # 9^(9^(9^9)): sympy evaluates the integer power in C and would never return.
        assert pool.grade([("so the answer is \\boxed{9^{9^{9^{9}}}}", "2")]) == [0.0]
        assert time.monotonic() - start < 1.0 + 2.0
        assert pool.stats()["timeouts"] == 1
        # The killed worker was replaced: grading goes on, right and wrong answers alike.
        assert pool.grade([("\\boxed{7}", "7"), ("\\boxed{8}", "7")]) == [1.0, 0.0]
        assert pool.stats() == {"calls": 4, "timeouts": 1, "worker_errors": 0}
    finally:
        pool.close()


def process_gone(pid: int) -> bool:
    """No such process, or a zombie (its parent died and nobody reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stuck_worker_does_not_outlive_its_dead_parent():
    """The parent is killed while its worker is stuck in sympy: the worker's own alarm ends it."""
    code = (
        "from sage_train.tasks.grading import GradingPool\n"
        "pool = GradingPool(processes=1, timeout_s=1.0)\n"
        "pool.grade([('\\\\boxed{1}', '1')])\n"
        "print(pool.pids()[0], flush=True)\n"
        "pool.grade([('\\\\boxed{9^{9^{9^{9}}}}', '2')])\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    worker = int(parent.stdout.readline())
    time.sleep(0.2)  # the request is on its way; the worker is computing
    parent.kill()
    parent.wait()
    start = time.monotonic()
    assert not process_gone(worker)
    while not process_gone(worker) and time.monotonic() - start < 20:
        time.sleep(0.1)
    assert process_gone(worker)  # after ceil(1.0) + 5 s of its own, not never


def test_grading_from_other_threads_installs_no_signal_handler():
    handler = signal.getsignal(signal.SIGALRM)
    results = {}

    def grade(name, completion, gold):
        results[name] = math_reward(completion, gold)

    threads = [threading.Thread(target=grade, args=(f"t{i}", f"\\boxed{{{i}+1}}", str(i + 1))) for i in range(4)]
    threads.append(threading.Thread(target=grade, args=("wrong", "\\boxed{x^2}", "x^3")))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {"t0": 1.0, "t1": 1.0, "t2": 1.0, "t3": 1.0, "wrong": 0.0}
    assert signal.getsignal(signal.SIGALRM) is handler
    assert grading_stats()["calls"] >= 5


def test_bad_pool_arguments_are_named():
    with pytest.raises(ValueError, match="processes"):
        GradingPool(processes=0)
    with pytest.raises(ValueError, match="timeout_s"):
        GradingPool(timeout_s=0)
