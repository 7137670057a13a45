"""Multi-digit integer arithmetic: "12+34" -> 46.

Options:
    digits:   every operand has exactly this many digits (1: 0..9; 2: 10..99; ...). Default 2.
    ops:      the operators to draw from, any of "+", "-", "*". Default "+".
    operands: how many numbers per problem (>= 2). Default 2.
    template: "plain" (default, "12+34="), "instruct" (a sentence asking for `\\boxed{}`),
              "question" ("What is 12+34?"), or a custom string containing "{question}".
    grading:  "free" (default) or "strict", the rules of `answer.py`.

The defaults (2-digit addition) are the easy setting a tiny character-level model learns by
supervised fine-tuning and then improves on with RL in minutes on a CPU.

Questions use the usual precedence ("2+3*4" is 14); the answer may be negative.
Grading, "free": the answer is a number (thousands commas allowed: "1,234"; a decimal part
compares by value: "71.0" is 71, "71.5" is not) that is not an operand of an arithmetic
expression, i.e. has no operator (+ - * / x × ÷, spaces allowed) right before or after it:
"23 + 48 = 71" says 71, never 23 or 48, so a restated question is no answer. The first such
number of the span of `answer.free_span` counts (the box, the text after "the answer is", else
the whole completion). "strict": the span of `answer.answer_span`
must start with the gold integer, not followed by further digits or a decimal part.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import ClassVar

from .answer import answer_span, check_grading, free_number
from .base import Problem
from .synthetic import problem_id, render, resolve_template, sample_problems

TEMPLATES = {
    "plain": "{question}=",
    "instruct": "Compute {question}. Put the final answer in \\boxed{}.",
    "question": "What is {question}?",
}
OPERATORS = "+-*"
_LEADING_INTEGER = re.compile(r"\s*(-?(?:\d{1,3}(?:,\d{3})+|\d+))(?!\d|[,.]\d)", re.ASCII)


@dataclass(frozen=True)
class ArithmeticTask:
    """Seeded multi-digit arithmetic problems with an exact integer verifier."""

    digits: int = 2
    ops: str = "+"
    operands: int = 2
    template: str = "plain"
    grading: str = "free"
    name: ClassVar[str] = "arithmetic"

    def __post_init__(self):
        if not isinstance(self.digits, int) or not 1 <= self.digits <= 18:
            raise ValueError(f"digits must be an integer in [1, 18], got {self.digits!r}")
        if not self.ops or not set(self.ops) <= set(OPERATORS):
            raise ValueError(f"ops must be a non-empty string of {OPERATORS!r}, got {self.ops!r}")
        if not isinstance(self.operands, int) or self.operands < 2:
            raise ValueError(f"operands must be an integer >= 2, got {self.operands!r}")
        resolve_template(self.template, TEMPLATES)
        check_grading(self.grading)

    @property
    def max_answer_chars(self) -> int:
        """Characters of the longest possible answer (a bound for `max_new_tokens`)."""
        # |value| <= largest_operand ** operands: products of groups of operands, summed,
        # never exceed the product of all when every factor is at most that large (>= 2).
        return len(str((10**self.digits - 1) ** self.operands)) + 1

    def problems(self, split: str, n: int | None, seed: int) -> list[Problem]:
        """Up to `n` distinct problems of `split` ("train" or "test"), deterministic in `seed`."""
        return sample_problems(self.name, split, n, seed, self._draw)

    def prompt(self, problem: Problem) -> str:
        """The model input: the template filled with the question."""
        return render(resolve_template(self.template, TEMPLATES), problem.question)

    def score(self, completion: str, problem: Problem) -> float:
        """1.0 if the completion's answer is the gold integer, else 0.0 (the rule of ``grading``)."""
        # Decimal, not int: Python refuses int() of more than 4300 digits, a completion may hold more
        if self.grading == "free":
            return float(free_number(completion) == Decimal(problem.answer))
        match = _LEADING_INTEGER.match(answer_span(completion))
        if match is None:
            return 0.0
        return float(Decimal(match.group(1).replace(",", "")) == Decimal(problem.answer))

    def _draw(self, rng: random.Random) -> tuple[str, Callable[[], Problem]]:
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        numbers = [rng.randint(low, 10**self.digits - 1) for _ in range(self.operands)]
        ops = [rng.choice(self.ops) for _ in range(self.operands - 1)]
        question = str(numbers[0]) + "".join(op + str(x) for op, x in zip(ops, numbers[1:]))
        answer = str(evaluate(numbers, ops))
        problem = Problem(
            id=problem_id(self.name, question),
            question=question,
            answer=answer,
            meta={"sft_completion": answer, "numbers": numbers, "ops": ops},
        )
        return question, lambda: problem


def evaluate(numbers: list[int], ops: list[str]) -> int:
    """numbers[0] ops[0] numbers[1] ... with "*" binding tighter than "+" and "-"."""
    total, sign, product = 0, 1, numbers[0]
    for op, x in zip(ops, numbers[1:]):
        if op == "*":
            product *= x
        else:
            total += sign * product
            sign, product = (1 if op == "+" else -1), x
    return total + sign * product
