"""Knights and knaves: the question text, read independently, has exactly the stated solution;
the verifier against every assignment."""

import itertools
import re

import pytest

from sage_train.tasks.knights import NAMES, KnightsTask, format_assignment, parse_assignment

_ROLE = r"([A-H]) is a (knight|knave)"
_FORMS = {
    "is": re.compile(_ROLE),
    "and": re.compile(f"{_ROLE} and {_ROLE}"),
    "or": re.compile(f"{_ROLE} or {_ROLE}"),
    "same": re.compile(r"([A-H]) and ([A-H]) are the same kind"),
    "different": re.compile(r"([A-H]) and ([A-H]) are different kinds"),
}


def statement_holds(text, knights):
    """Truth of one statement's English text, with knights a dict name -> bool."""
    matches = {kind: form.fullmatch(text) for kind, form in _FORMS.items()}
    matches = {kind: m for kind, m in matches.items() if m}
    assert len(matches) == 1, text
    ((kind, m),) = matches.items()
    if kind in ("same", "different"):
        return (knights[m[1]] == knights[m[2]]) == (kind == "same")
    first = knights[m[1]] == (m[2] == "knight")
    if kind == "is":
        return first
    second = knights[m[3]] == (m[4] == "knight")
    return first and second if kind == "and" else first or second


def brute_force_solutions(question, people):
    said = dict(re.findall(r"([A-H]): ([^.]*)\.", question))
    assert sorted(said) == list(NAMES[:people])
    solutions = []
    for roles in itertools.product([True, False], repeat=people):
        knights = dict(zip(NAMES, roles))
        if all(statement_holds(text, knights) == knights[name] for name, text in said.items()):
            solutions.append(roles)
    return solutions


@pytest.mark.parametrize("people", range(2, 9))
def test_every_puzzle_has_exactly_the_stated_solution(people):
    task = KnightsTask(people=people)
    for problem in task.problems("train", 8, seed=people):
        solutions = brute_force_solutions(problem.question, people)
        assert len(solutions) == 1
        assert problem.answer == format_assignment(solutions[0]) == problem.meta["sft_completion"]
        assert len(problem.answer) <= task.max_answer_chars


def test_verifier_against_every_assignment():
    task = KnightsTask(people=4)
    for problem in task.problems("test", 3, seed=0):
        (solution,) = brute_force_solutions(problem.question, 4)
        for roles in itertools.product([True, False], repeat=4):
            pairs = [f"{NAMES[i]}={'knight' if r else 'knave'}" for i, r in enumerate(roles)]
            expected = float(roles == solution)
            assert task.score(",".join(pairs), problem) == expected
            assert task.score(" ; ".join(reversed(pairs)).upper(), problem) == expected


@pytest.mark.parametrize(
    "completion, gradings",
    [
        ("{canonical}", ("free", "strict")),
        ("{canonical}<|endoftext|>", ("free", "strict")),
        ("{canonical}\nC=knight", ("strict",)),  # strict: the first line
        ("Let me think.\n{sentences}\nSo that is it.", ("free",)),  # free: the first line with a pair
        ("\\boxed{{{canonical}}}", ("free", "strict")),
        ("{sentences}", ("free", "strict")),
        ("{lower}", ("free", "strict")),
        ("{shuffled}", ("free", "strict")),
        ("Answer: {sentences} That is all.", ("free", "strict")),
    ],
)
def test_tolerant_forms_of_the_solution_score_one(completion, gradings):
    for grading in gradings:
        task = KnightsTask(people=3, grading=grading)
        problem = task.problems("train", 1, seed=0)[0]
        pairs = problem.answer.split(",")
        sentences = " ".join(re.sub(r"(\w)=(\w+)", r"\1 is a \2.", p) for p in pairs)
        text = completion.format(
            canonical=problem.answer, sentences=sentences, lower=problem.answer.lower(), shuffled="; ".join(pairs[::-1])
        )
        assert task.score(text, problem) == 1.0


def test_wrong_or_incomplete_assignments_score_zero():
    task = KnightsTask(people=3)
    problem = task.problems("train", 1, seed=0)[0]
    swap = {"knight": "knave", "knave": "knight"}
    for i in range(3):
        pairs = problem.answer.split(",")
        name, role = pairs[i].split("=")
        pairs[i] = f"{name}={swap[role]}"
        assert task.score(",".join(pairs), problem) == 0.0
    answer = problem.answer
    for completion in [
        answer.rsplit(",", 1)[0],
        answer + ",D=knight",
        answer + ",A=knight,A=knave",
        answer.replace("knight", "knights"),
        answer.replace("k", "\u212a"),
        "A knight",
        "",
        "\n\n",
        "\\boxed{" + answer,
    ]:
        assert task.score(completion, problem) == 0.0, completion


def test_consistent_repeats_are_tolerated():
    assert parse_assignment("A=knight,B=knave,A=knight", 2) == (True, False)
    assert parse_assignment("A=knight,B=knave,A=knave", 2) is None


@pytest.mark.parametrize(
    "options, argument",
    [
        ({"people": 1}, "people"),
        ({"people": 9}, "people"),
        ({"template": "x"}, "template"),
    ],
)
def test_bad_options_name_the_argument(options, argument):
    with pytest.raises(ValueError, match=argument):
        KnightsTask(**options)
