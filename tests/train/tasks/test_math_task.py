"""MathTask: the shipped benchmark files, jsonl golds from `answer` or the last boxed solution,
the prompt, grading through math_reward, and clear errors."""

from __future__ import annotations

import json

import pytest

from sage_train.tasks import get_task
from sage_train.tasks.answer import last_boxed
from sage_train.tasks.math import MathTask


@pytest.mark.parametrize(
    "name, rows", [("math500", 500), ("aime24", 30), ("aime25", 30), ("amc23", 40), ("minerva", 272)]
)
def test_benchmark_names_resolve_to_the_shared_files(name, rows, math_data, monkeypatch):
    monkeypatch.setenv("SAGE_MATH_DATA", str(math_data))
    task = get_task(name)
    problems = task.problems("test", None, 0)
    assert task.name == name and len(problems) == rows
    assert len({p.id for p in problems}) == rows
    assert all(p.question and p.answer for p in problems)
    assert task.problems("test", 3, 7) == problems[:3]  # a fixed list: n is a prefix, seed changes nothing


def test_golds_from_answer_or_last_boxed_solution(math_data, monkeypatch):
    monkeypatch.setenv("SAGE_MATH_DATA", str(math_data))
    assert get_task("amc23").problems()[0].answer == "27"  # JSON 27.0, written as models write it
    assert get_task("math500").problems()[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    first_minerva = json.loads((math_data / "minerva_math.jsonl").read_text().splitlines()[0])
    assert "answer" not in first_minerva
    assert get_task("minerva").problems()[0].answer == last_boxed(first_minerva["solution"]).strip() == "1.6"


def test_jsonl_path_prompt_and_score(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"problem": "What is 1/2 + 1/3?", "answer": "\\frac{5}{6}"},
        {"question": "Square of 3?", "solution": "It is $\\boxed{9}$, or \\boxed{\\{9\\}}."},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = MathTask(str(path))
    first, second = task.problems()
    assert task.name == "mine" and first.id == "mine/0"
    assert second.answer == "\\{9\\}"
    assert task.prompt(first) == (
        "What is 1/2 + 1/3?\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    assert MathTask(str(path), template="Q: {question}\nA:").prompt(first) == "Q: What is 1/2 + 1/3?\nA:"
    assert task.score("1/2 + 1/3 = 5/6, so \\boxed{\\dfrac{5}{6}}.", first) == 1.0
    assert task.score("\\boxed{0.8333}", first) == 0.0
    assert task.score_batch(["\\boxed{5/6}", "\\boxed{1}"], [first, first]) == [1.0, 0.0]


def test_bad_sources_and_options_are_named(tmp_path):
    with pytest.raises(ValueError, match="source must be one of"):
        MathTask("nope")
    with pytest.raises(ValueError, match="template"):
        MathTask("math500", template="no placeholder")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "x", "solution": "no box"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: no 'answer'"):
        MathTask(str(bad))
    with pytest.raises(TypeError, match="unknown option"):
        get_task("math500", digits=3)


@pytest.mark.parametrize(
    "completion, score",
    [
        ("Let me compute 94+22.", 0.0),  # a restated question is no answer (math-verify read 22 from it)
        ("The answer to 94 + 22 is 24.", 0.0),
        ("94 + 22 = 116", 1.0),
        ("The answer is 116.", 1.0),
        ("So the answer is: **116**, since 94 + 22 = 116.", 1.0),
        ("We add: 90 + 20 = 110 and 4 + 2 = 6, total 116.", 0.0),  # the first result is read: 110
        ("<answer>116</answer>", 1.0),
        ("\\boxed{116}", 1.0),
        ("No number here.", 0.0),
    ],
)
def test_without_a_box_the_answer_is_read_as_instruct_models_state_it(tmp_path, completion, score):
    path = tmp_path / "sum.jsonl"
    path.write_text(json.dumps({"problem": "What is 94 + 22?", "answer": "116"}) + "\n")
    task = MathTask(str(path))
    assert task.score(completion, task.problems()[0]) == score
