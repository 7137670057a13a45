"""Countdown: the solver and the verifier against brute-force enumeration of expressions."""

import itertools
from fractions import Fraction

import pytest

from sage_train.tasks.countdown import CountdownTask, evaluate_expression, solve


def all_expressions(numbers):
    """Every fully parenthesised expression over a nonempty subset of positions, as
    (positions used, text, value or None when some division is inexact or by zero)."""

    def trees(positions):
        if len(positions) == 1:
            (i,) = positions
            return [(str(numbers[i]), Fraction(numbers[i]))]
        found = []
        for size in range(1, len(positions)):
            for left in itertools.combinations(sorted(positions), size):
                right = positions - set(left)
                for (lt, lv), (rt, rv) in itertools.product(trees(frozenset(left)), trees(right)):
                    for op in "+-*/":
                        if lv is None or rv is None:
                            value = None
                        elif op == "/":
                            value = lv / rv if rv != 0 and (lv / rv).denominator == 1 else None
                        else:
                            value = {"+": lv + rv, "-": lv - rv, "*": lv * rv}[op]
                        found.append((f"({lt}{op}{rt})", value))
        return found

    everything = []
    for size in range(1, len(numbers) + 1):
        for subset in itertools.combinations(range(len(numbers)), size):
            everything += [(frozenset(subset), text, value) for text, value in trees(frozenset(subset))]
    return everything


@pytest.mark.parametrize("numbers", [[3, 5, 7], [2, 2, 6], [1, 4, 4, 9], [6, 3, 0]])
@pytest.mark.parametrize("use_all", [False, True])
def test_solver_finds_exactly_the_brute_force_values(numbers, use_all):
    expected = {
        int(value)
        for used, _, value in all_expressions(numbers)
        if value is not None and (not use_all or len(used) == len(numbers))
    }
    reachable = solve(numbers, use_all)
    assert set(reachable) == expected
    for value, text in reachable.items():
        assert evaluate_expression(text, numbers, use_all) == value, text


def test_solver_keeps_a_shortest_expression():
    reachable = solve([3, 5, 7])
    assert reachable[56] in ("(3+5)*7", "(5+3)*7", "7*(3+5)", "7*(5+3)")
    assert reachable[15] in ("3*5", "5*3")
    assert reachable[-2] == "3-5"
    assert reachable[3] == "3"


@pytest.mark.parametrize("use_all", [False, True])
def test_verifier_against_every_expression(use_all):
    task = CountdownTask(numbers=3, use_all=use_all)
    for problem in task.problems("train", 3, seed=1):
        numbers, target = problem.meta["numbers"], problem.meta["target"]
        for used, text, value in all_expressions(numbers):
            allowed = not use_all or len(used) == len(numbers)
            expected = float(allowed and value is not None and value == target)
            assert task.score(text, problem) == expected, text


@pytest.mark.parametrize(
    "options", [{}, {"numbers": 4, "max_number": 25, "max_target": 200}, {"numbers": 2, "use_all": True}]
)
def test_problems_are_solvable_within_the_options(options):
    task = CountdownTask(**options)
    for problem in task.problems("test", 20, seed=0):
        numbers, target = problem.meta["numbers"], problem.meta["target"]
        assert len(numbers) == task.numbers and all(1 <= x <= task.max_number for x in numbers)
        assert 1 <= target <= task.max_target and target not in numbers
        assert problem.question == f"Make {target} with {' '.join(map(str, numbers))}"
        assert evaluate_expression(problem.meta["solution"], numbers, task.use_all) == target
        assert problem.answer == problem.meta["sft_completion"] == problem.meta["solution"]
        assert len(problem.answer) <= task.max_answer_chars


@pytest.mark.parametrize(
    "text, numbers, use_all, value",
    [
        ("(3+5)*7", [3, 5, 7], False, 56),
        (" 3 + 5 * 7 ", [3, 5, 7], False, 38),
        ("7-5-3", [3, 5, 7], False, -1),
        ("8/4/2", [8, 4, 2], False, 1),
        ("8/(4/2)", [8, 4, 2], False, 4),
        ("3*3", [3, 5], False, None),  # 3 given once, used twice
        ("3*3", [3, 3], False, 9),  # 3 given twice
        ("3*4", [3, 5], False, None),  # 4 not given
        ("7/2*2", [7, 2, 2], False, None),  # inexact division
        ("5/(3-3)", [5, 3, 3], False, None),  # division by zero
        ("07+1", [7, 1], False, None),  # leading zero
        ("-3+5", [3, 5], False, None),  # unary minus
        ("3+5", [3, 5, 7], True, None),  # 7 unused under use_all
        ("(3+5", [3, 5], False, None),
        ("3+5)", [3, 5], False, None),
        ("3 5", [3, 5], False, None),
        ("()", [3], False, None),
        ("", [3], False, None),
        ("3+", [3], False, None),
    ],
)
def test_evaluate_expression_rules(text, numbers, use_all, value):
    assert evaluate_expression(text, numbers, use_all) == value


def test_deep_or_long_expressions_are_rejected_without_error():
    assert evaluate_expression("(" * 40 + "3" + ")" * 40, [3], False) is None
    assert evaluate_expression("(" * 20 + "3" + ")" * 20, [3], False) == 3
    assert evaluate_expression("1+" * 200 + "1", [1] * 201, False) is None


@pytest.mark.parametrize(
    "completion, strict, free",
    [
        ("{s}", 1.0, 1.0),
        ("{s}=56", 1.0, 1.0),
        ("{s}<|endoftext|>", 1.0, 1.0),
        ("{s}\nanything", 1.0, 1.0),
        ("\\boxed{{{s}}}", 1.0, 1.0),
        ("So the answer: {s}", 1.0, 1.0),
        ("{s}+0", 0.0, 0.0),
        ("{s}*1", 0.0, 0.0),
        ("56", 0.0, 0.0),
        ("= {s}", 0.0, 1.0),
        ("\\boxed{{{s}", 0.0, 0.0),
        ("I would try 1+2 first. Then: {s} works", 0.0, 0.0),  # free: the first expression
        ("The answer is **{s}**. Not 1+2.", 0.0, 1.0),  # free: the first after the marker
        ("Let me see: {s} = 56. Or 1+2.", 0.0, 1.0),
        ("{s}\nor maybe 1+2", 1.0, 1.0),
    ],
)
def test_reading_the_expression_from_a_completion(completion, strict, free):
    problem = CountdownTask().problems("train", 1, seed=0)[0]
    text = completion.format(s=problem.answer)
    assert CountdownTask(grading="strict").score(text, problem) == strict
    assert CountdownTask().score(text, problem) == free
    assert CountdownTask().score(completion.format(s=problem.answer.replace("*", " × ")), problem) == free


@pytest.mark.parametrize(
    "options, argument",
    [
        ({"numbers": 1}, "numbers"),
        ({"numbers": 7}, "numbers"),
        ({"max_number": 0}, "max_number"),
        ({"max_target": 0}, "max_target"),
        ({"use_all": 1}, "use_all"),
        ({"template": "x"}, "template"),
    ],
)
def test_bad_options_name_the_argument(options, argument):
    with pytest.raises(ValueError, match=argument):
        CountdownTask(**options)
