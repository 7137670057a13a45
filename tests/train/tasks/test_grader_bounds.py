"""Graders run in the trainer's process on whatever a model writes: bounded in time on any completion
(long runs of digits, parentheses, unclosed tags, operators), never raising on an answer Python cannot
convert (more than 4300 digits), and reading as before every completion the old rules read. The old
rules are kept here as the references: the regular expressions and slicing that were quadratic."""

import json
import re
import time
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sage_train.tasks import answer, knights
from sage_train.tasks.arithmetic import ArithmeticTask
from sage_train.tasks.base import Problem
from sage_train.tasks.countdown import CountdownTask, free_expression
from sage_train.tasks.grading import grading_stats
from sage_train.tasks.knights import KnightsTask
from sage_train.tasks.math import (
    MAX_GRADED_CHARS,
    MathTask,
    answer_for_grading,
    last_answer_tags,
    scientific_written_out,
)

#: the size of a hostile completion: a quadratic grader takes minutes here (30 s at 80 KB), a linear
#: one well under a second
SIZE = 400_000
#: the generous bound for grading one of them (a hang guard on a loaded machine, not a benchmark)
BOUND_S = 10.0

HOSTILE = {
    "digits": "7" * SIZE,
    "digits and spaces": "1 " * (SIZE // 2),
    "parentheses": "(" * SIZE,
    "operands": "1+" * (SIZE // 2),
    "spaced operands": "1 - " * (SIZE // 4),
    "unclosed answer tags": "<answer>" * (SIZE // 8),
    "unclosed boxes": "\\boxed{" * (SIZE // 7),
    "answer markers": "the answer is " * (SIZE // 14),
    "knights": "a is a knight " * (SIZE // 14),
    "scientific": "1e5 " * (SIZE // 4),
    # the old knights pair pattern tried every split of a run of spaces between "\s*" and "\s+is": cubic
    "spaced knight pair": "a" + " " * (SIZE // 2) + "is" + " " * (SIZE // 2),
    "spaced knight pair said": "The answer is: a" + "\n" * (SIZE // 2) + "is an" + "\t" * (SIZE // 2) + "k",
    "spaced knight separators": ("a" + " " * 999 + "is" + " " * 999 + "a" + " " * 999 + "=") * (SIZE // 3000),
    "spaced scientific": ("1" + " " * 999 + "e" + " " * 999) * (SIZE // 2000),
    "scientific, written out long": "1e399 " * (SIZE // 6),
    "scientific, a long exponent": "1e" + "9" * SIZE,
}
TASKS = {
    f"{name}-{grading}": make(grading=grading)
    for name, make in (("arithmetic", ArithmeticTask), ("countdown", CountdownTask), ("knights", KnightsTask))
    for grading in ("free", "strict")
}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_synthetic_grader_is_bounded_on_hostile_completions(task):
    grader = TASKS[task]
    problem = grader.problems("test", 1, 0)[0]
    for name, completion in HOSTILE.items():
        start = time.perf_counter()
        assert grader.score(completion, problem) in (0.0, 1.0)
        assert time.perf_counter() - start < BOUND_S, (task, name)


def test_the_issue_knights_pair_is_graded_at_once():
    """ "a", 2000 spaces, "is", 2000 spaces: 33 s with the old pair pattern (issue 46), growing as n^3."""
    grader = KnightsTask(grading="strict")
    problem = grader.problems("test", 1, 0)[0]
    for n in (2_000, 20_000):
        start = time.perf_counter()
        assert grader.score("a" + " " * n + "is" + " " * n, problem) == 0.0
        assert time.perf_counter() - start < 0.5, n


@pytest.mark.parametrize("grading", ["free", "strict"])
def test_the_knights_grader_takes_a_million_characters_of_spaced_pairs_in_linear_time(grading):
    """Each run of spaces read once: a million characters of pairs separated by long runs of spaces,
    tabs and newlines (a quadratic reading needs 10^12 steps here) graded within the hang guard, and
    the one pair said at the end of them still read."""
    grader = KnightsTask(people=2, grading=grading)
    problem = grader.problems("test", 1, 0)[0]
    gap = " \t" * 130_000
    answer = problem.answer.replace("=", gap + "is a" + gap).replace(",", " and ")
    completion = ("b" + gap + "is" + gap + "a") * 4 + "\nAnswer: " + answer if grading == "strict" else answer
    assert len(completion) > 1_000_000
    start = time.perf_counter()
    assert grader.score(completion, problem) == 1.0
    assert time.perf_counter() - start < BOUND_S


OLD_PAIR = re.compile(
    r"(?<![a-z])([a-z])\s*(?:=|:|-|\s+is(?:\s+an?)?\s+)\s*(knight|knave)(?![a-z])", re.IGNORECASE | re.ASCII
)


@settings(max_examples=400, deadline=None)
@given(
    st.text(alphabet="abAB =:-\n\tisnKkx", max_size=40).map(lambda t: t.replace("K", "knight").replace("x", "knave"))
)
def test_the_knights_pair_pattern_reads_what_the_old_one_read(text):
    assert knights._PAIR.findall(text) == OLD_PAIR.findall(text)


def test_math_answer_extraction_is_bounded_on_hostile_completions():
    """What runs in the trainer's process before math-verify's own (killed) worker: the extraction."""
    for name, completion in HOSTILE.items():
        start = time.perf_counter()
        answer_for_grading(completion)
        assert time.perf_counter() - start < BOUND_S, name


@pytest.mark.parametrize("grading", ["free", "strict"])
def test_answers_longer_than_pythons_int_limit_are_graded_not_raised(grading):
    digits = "12345" * 1000  # 5000 digits: int() refuses more than 4300
    task = ArithmeticTask(grading=grading)
    problem = Problem(id="long", question="a long sum", answer=digits)
    assert task.score(digits, problem) == 1.0
    assert task.score(digits[:-1] + "0", problem) == 0.0
    assert task.score("-" + digits, problem) == 0.0


# --- the same readings as the old rules -----------------------------------------------------------------

TEXT = st.text(alphabet="0123456789 +-*/()x×÷.,=\nab<>/answer is:", max_size=60)


def old_answers(text: str):
    """The number reader before it read by position (slicing around every number: quadratic)."""
    for match in answer._NUMBER.finditer(text):
        before, after = text[: match.start()].rstrip(), text[match.end() :].lstrip()
        sign, digits, decimals = match.groups()

        def ends_a_term(part: str) -> bool:
            last = part.rstrip()[-1:]
            return last.isdigit() or last == ")"

        if sign and ends_a_term(before):
            continue
        if not sign and before[-1:] in answer._OPERATORS and ends_a_term(before[:-1]):
            continue
        if after[:1] in answer._OPERATORS and after[1:].lstrip()[:1] in tuple("0123456789("):
            continue
        value = Decimal(digits.replace(",", "") + (decimals or ""))
        yield -value if sign else value


OLD_EXPRESSION_RUN = re.compile(r"[0-9+\-*/()×÷ ]*[+\-*/×÷][0-9+\-*/()×÷ ]*")


def old_free_expression(completion: str) -> str:
    span = answer.free_span(completion)[0].replace("**", " ")
    runs = [run for run in OLD_EXPRESSION_RUN.findall(span) if any(c.isdigit() for c in run)]
    return runs[0].replace("×", "*").replace("÷", "/").strip() if runs else ""


def old_answer_tags(completion: str):
    matches = re.findall(r"<answer>(.*?)</answer>", completion, flags=re.DOTALL)
    return matches[-1] if matches else None


@settings(max_examples=400, deadline=None)
@given(TEXT)
def test_the_linear_readers_read_what_the_old_rules_read(text):
    assert list(answer._answers(text)) == list(old_answers(text))
    assert free_expression(text) == old_free_expression(text)
    tagged = text.replace("ab", "<answer>").replace("is:", "</answer>")
    assert last_answer_tags(tagged) == old_answer_tags(tagged)


@pytest.mark.parametrize(
    "completion, gold, score",
    [
        ("so the result is \\boxed{2e3}", "2000", 1.0),
        ("The answer is 2e3.", "2000", 1.0),
        ("The answer is 2e3.", "2", 0.0),  # math-verify alone reads 2 here
        ("The answer is 1.5E-2", "0.015", 1.0),
        ("<answer>6.02e23</answer>", "602000000000000000000000", 1.0),
        ("so the result is \\boxed{2e4}", "2000", 0.0),
        # not their mantissas (issue 46 item 8), in text, boxes and tags, and as golds
        ("The answer is 1e100.", "10^{100}", 1.0),
        ("The answer is 1e100.", "1", 0.0),
        ("The answer is 1e100.", "3e100", 0.0),
        ("so the result is \\boxed{3e100}", "3", 0.0),
        ("so the result is \\boxed{3e100}", "3\\times 10^{100}", 1.0),
        ("so the result is \\boxed{10^{100}}", "1e100", 1.0),
        ("so the result is \\boxed{10^{100}}", "3e100", 0.0),
        ("The answer is 1.5e-300", "1.5", 0.0),
        ("The answer is 1.5e-300", "0", 0.0),
        ("<answer>1.5e-300</answer>", "1.5\\times 10^{-300}", 1.0),
        ("The answer is 1E+100", "1" + "0" * 100, 1.0),
        # past the digits written out: exact in LaTeX, in text too, and inside $...$
        ("The answer is 1e1000", "10^{1000}", 1.0),
        ("The answer is 1e1000", "1", 0.0),
        ("The answer is $x = 3e1000$", "3\\times 10^{1000}", 1.0),
        ("so the result is \\boxed{3e1000}", "10^{1000}", 0.0),
    ],
)
def test_scientific_notation_is_read_as_the_number_it_writes(tmp_path, completion, gold, score):
    """math-verify alone reads "2e3" as 2*e*3 in a box and as 2 in text, "1e100" as 1."""
    (tmp_path / "one.jsonl").write_text(json.dumps({"problem": "p", "answer": gold}) + "\n")
    task = MathTask(str(tmp_path / "one.jsonl"))
    assert task.score(completion, task.problems()[0]) == score


def test_numbers_in_scientific_notation_add_a_bounded_length():
    """Written out in digits up to 400 of them and 100,000 in all, then as "m\\times10^{k}": a
    completion of exponents cannot grow a hundredfold on its way to math-verify."""
    for completion in (HOSTILE["scientific, written out long"], HOSTILE["scientific, a long exponent"]):
        assert len(scientific_written_out(completion)) <= 4 * len(completion) + 100_000
    assert scientific_written_out("1.5e-300") == "0." + "0" * 299 + "15"
    assert scientific_written_out("1e1000 and $2.5E-1000$") == "$1\\times10^{1000}$ and $2.5\\times10^{-1000}$"


def test_math_grading_of_hostile_completions_is_bounded_end_to_end(tmp_path):
    """What math-verify gets is the end of a completion, at most MAX_GRADED_CHARS: every hostile
    completion is graded (none timed out), and an answer boxed after a million characters still counts."""
    (tmp_path / "one.jsonl").write_text(json.dumps({"problem": "p", "answer": "7"}) + "\n")
    task = MathTask(str(tmp_path / "one.jsonl"))
    long_answer = "so we add the terms. " * 50_000 + "\\boxed{7}"
    hostile = ("digits", "unclosed boxes", "answer markers", "spaced knight pair said", "scientific, written out long")
    completions = [*(HOSTILE[name] for name in hostile), long_answer]
    assert all(len(answer_for_grading(c)) <= MAX_GRADED_CHARS for c in completions)
    before = grading_stats()
    start = time.perf_counter()
    scores = task.score_batch(completions, task.problems() * len(completions))
    assert time.perf_counter() - start < 3 * BOUND_S
    assert scores[-1] == 1.0 and set(scores[:-1]) == {0.0}
    assert grading_stats()["timeouts"] == before["timeouts"]
