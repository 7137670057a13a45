"""Arithmetic: generation against Python's own evaluation, and the verifier's reading rule."""

import itertools
import re
from decimal import Decimal

import pytest

from sage_train.tasks.answer import free_number
from sage_train.tasks.arithmetic import ArithmeticTask, evaluate
from sage_train.tasks.base import Problem


@pytest.mark.parametrize("digits, ops, operands", [(1, "+-*", 2), (2, "+", 2), (3, "+-*", 4), (5, "-*", 3)])
def test_answers_match_python(digits, ops, operands):
    task = ArithmeticTask(digits=digits, ops=ops, operands=operands)
    for problem in task.problems("train", 50, seed=3):
        numbers = re.split(r"[-+*]", problem.question)
        assert len(numbers) == operands
        assert all(len(x) == digits for x in numbers)
        assert set(re.sub(r"\d", "", problem.question)) <= set(ops)
        # The question holds only digits and + - *, so Python evaluates it with the same precedence.
        assert int(problem.answer) == eval(problem.question)
        assert problem.meta["sft_completion"] == problem.answer


def test_evaluate_all_small_expressions_against_python():
    for a, b, c in itertools.product(range(10), repeat=3):
        for op1, op2 in itertools.product("+-*", repeat=2):
            assert evaluate([a, b, c], [op1, op2]) == eval(f"{a}{op1}{b}{op2}{c}")


def test_max_answer_chars_bounds_every_answer():
    task = ArithmeticTask(digits=1, ops="+-*", operands=3)
    longest = max(
        len(str(evaluate([a, b, c], [o1, o2])))
        for a, b, c in itertools.product(range(10), repeat=3)
        for o1, o2 in itertools.product("+-*", repeat=2)
    )
    assert longest <= task.max_answer_chars


@pytest.mark.parametrize("grading", ["free", "strict"])
def test_verifier_against_every_nearby_integer(grading):
    task = ArithmeticTask(digits=3, ops="*", operands=2, grading=grading)
    problem = task.problems("test", 1, seed=0)[0]
    gold = int(problem.answer)
    for guess in range(gold - 300, gold + 301):
        expected = float(guess == gold)
        assert task.score(str(guess), problem) == expected
        assert task.score(f"{guess:,}", problem) == expected
        assert task.score(f"\\boxed{{{guess}}}", problem) == expected


def test_prompt_is_the_bare_expression():
    task = ArithmeticTask()
    problem = task.problems("train", 1, seed=0)[0]
    assert re.fullmatch(r"\d\d\+\d\d=", task.prompt(problem))
    assert task.prompt(problem) == problem.question + "="
    instruct = ArithmeticTask(template="instruct").prompt(problem)
    assert problem.question in instruct and "\\boxed{}" in instruct
    assert ArithmeticTask(template="Q: {question} A:").prompt(problem) == f"Q: {problem.question} A:"


@pytest.mark.parametrize("suffix", ["", "<|endoftext|>", "\n12", " apples", ", done", "."])
def test_trailing_text_after_the_answer_is_ignored_by_the_strict_rule(suffix):
    task = ArithmeticTask(grading="strict")
    problem = task.problems("train", 1, seed=0)[0]
    assert task.score(problem.answer + suffix, problem) == 1.0
    assert task.score(f"Answer: {problem.answer}{suffix}", problem) == 1.0


@pytest.mark.parametrize("grading", ["free", "strict"])
def test_wrong_or_malformed_answers_score_zero(grading):
    task = ArithmeticTask(grading=grading)
    problem = next(p for p in task.problems("train", 50, seed=0) if int(p.answer) >= 100)
    gold = problem.answer
    for completion in [
        gold + "0",
        gold + ".5",
        "-" + gold,
        gold[:-1],
        f"{gold[:-1]},{gold[-1]}",
        "",
        "\n",
        *(["=" + gold] if grading == "strict" else []),
        "x" + gold,
        "- " + gold,
        f"\\boxed{{{gold}",
        gold.translate(str.maketrans("0123456789", "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669")),
    ]:
        assert task.score(completion, problem) == 0.0, completion


@pytest.mark.parametrize(
    "options, argument",
    [
        ({"digits": 0}, "digits"),
        ({"digits": "2"}, "digits"),
        ({"ops": "/"}, "ops"),
        ({"ops": ""}, "ops"),
        ({"operands": 1}, "operands"),
        ({"template": "no placeholder"}, "template"),
        ({"grading": "loose"}, "grading"),
    ],
)
def test_bad_options_name_the_argument(options, argument):
    with pytest.raises(ValueError, match=argument):
        ArithmeticTask(**options)


FREE_FORMS = [  # (completion, the number it answers), as instruct models write them
    ("The answer is 116.", 116),
    ("23 + 48 = 71", 71),
    ("**71**", 71),
    ("\\boxed{71}", 71),
    ("23 + 48 = 71. So the number 71 is even, 3 + 3 = 6", 71),  # the first result: answer, then ramble
    ("69 + 59 = 128. The sum holds 10! bits", 128),  # a real SmolLM2 completion, shortened
    ("The answer is: 23 + 48 = 71. Check: 71 - 48 = 23", 71),  # the first after the marker
    ("The sum is $71$. Hope this helps!", 71),
    ("The result is 71.0", 71),
    ("1,234 is the total", 1234),
    ("x = 9 - 14 = -5", -5),
    ("2 x 3 = 6", 6),
    ("94 + 22 = 116\n", 116),
]


@pytest.mark.parametrize("completion, answer", FREE_FORMS)
def test_the_free_rule_reads_answers_as_instruct_models_write_them(completion, answer):
    assert free_number(completion) == answer
    problem = Problem(id="p", question="?", answer=str(answer))
    assert ArithmeticTask().score(completion, problem) == 1.0
    assert ArithmeticTask().score(completion, Problem(id="p", question="?", answer=str(answer + 1))) == 0.0


@pytest.mark.parametrize("completion", ["Let me compute 94+22.", "94 + 22", "7 - 5", "(2+3)*4", "71.5", "no number"])
def test_a_restated_question_or_no_answer_is_no_answer(completion):
    assert free_number(completion) in (None, Decimal("71.5"))
    for gold in ("22", "94", "2", "5", "4", "71"):
        assert ArithmeticTask().score(completion, Problem(id="p", question="?", answer=gold)) == 0.0


def test_the_free_rules_limit_operands_restated_in_words_are_read():
    assert free_number("The sum of 23 and 48 is 71.") == 23  # the first number that is no operand
