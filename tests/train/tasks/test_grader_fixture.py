"""The arithmetic grader on real completions: 112 answers SmolLM2-135M-Instruct sampled to the
smollm2-arithmetic recipe's prompts ("What is 23+48?" through its chat template, temperature 1,
48 new tokens), each labelled by hand with whether its final answer is the gold sum
(data/smollm2_arithmetic.jsonl; docs/results/smollm2.md reports the accuracy and the misreads).
No model is needed: the fixture is committed."""

import json
from pathlib import Path

from sage_train.tasks import ArithmeticTask
from sage_train.tasks.base import Problem

FIXTURE = Path(__file__).parent / "data" / "smollm2_arithmetic.jsonl"


def graded(task):
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    return rows, [task.score(r["completion"], Problem(id="p", question=r["question"], answer=r["gold"])) for r in rows]


def test_the_free_rule_agrees_with_the_hand_labels_of_real_completions():
    rows, scores = graded(ArithmeticTask(template="question"))
    assert len(rows) >= 100
    agree = sum(score == row["label"] for row, score in zip(rows, scores))
    assert agree / len(rows) >= 0.95, [(r["completion"], r["label"]) for r, s in zip(rows, scores) if s != r["label"]]
    assert 0 < sum(r["label"] for r in rows) < len(rows)  # both kinds are in it


def test_the_strict_rule_misses_most_correct_real_answers():
    rows, scores = graded(ArithmeticTask(template="question", grading="strict"))
    correct = [score for row, score in zip(rows, scores) if row["label"] == 1]
    assert sum(correct) < len(correct) / 2
