"""Countdown: reach a target from given numbers with + - * / and parentheses.

Rules (the verifier and the generator's solver apply the same ones):
    - each given number is used at most once (exactly once with `use_all=True`); a number
      given twice may be used twice; no other numbers, no unary minus, no leading zeros;
    - every operation is on integers, and a division only counts when it is exact
      (nonzero divisor, no remainder); intermediate results may be zero or negative.

Options:
    numbers:    how many numbers per problem, 2 to 6. Default 3.
    max_number: numbers are drawn from 1..max_number (repeats allowed). Default 10.
    max_target: targets are drawn from 1..max_target among the reachable values, never one
                of the given numbers (that would be trivial). Default 100.
    use_all:    every number exactly once instead of at most once. Default False.
    template:   "plain" (default, "Make 56 with 3 5 7" and a newline), "instruct" (states the
                rules, asks for `\\boxed{}`), or a custom string containing "{question}".
    grading:    "free" (default) or "strict", the rules of `answer.py`.

Every problem is solvable: the generator enumerates all values reachable under the rules
and keeps a shortest expression for the chosen target (`meta["solution"]`). Train and test
never share a multiset of numbers. Cost: about 0.2 s per problem with 6 numbers, under 10 ms
with 5 or fewer.
Grading: the expression must parse, obey the rules and evaluate to the target. "free": the
expression is a run of digits, operators (× and ÷ read as * and /), parentheses and spaces
holding an operator, the first of the span of `answer.free_span` (the box, the text after "the
answer is", else the whole completion): "(3 + 5) * 7 = 56" reads as "(3 + 5) * 7". "strict": the
longest prefix of the span of `answer.answer_span` made of digits, operators, parentheses and
spaces ("(3+5)*7=56" reads as "(3+5)*7").
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from .answer import answer_span, check_grading, free_span
from .base import Problem
from .synthetic import problem_id, render, resolve_template, sample_problems

_EXPRESSION_PREFIX = re.compile(r"[0-9+\-*/() ]*")
# a maximal run of expression characters; it is an expression when it holds an operator and a digit.
# (Not one pattern with the operator in it: that one backtracks over every start of a long run
# without an operator, quadratic in the run: 30 s on 80 KB of digits.)
_EXPRESSION_CHARS = re.compile(r"[0-9+\-*/()×÷ ]+")
_OPERATOR = re.compile(r"[+\-*/×÷]")
_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*/()]))")
_MAX_EXPRESSION_CHARS = 256  # bounds the work per completion
_MAX_DEPTH = 32  # parenthesis nesting, well below Python's recursion limit
_ATOM = 3  # precedence of a number (binds tightest)
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


@dataclass(frozen=True)
class CountdownTask:
    """Seeded, always-solvable countdown problems with an exact expression verifier."""

    numbers: int = 3
    max_number: int = 10
    max_target: int = 100
    use_all: bool = False
    template: str = "plain"
    grading: str = "free"
    name: ClassVar[str] = "countdown"

    def __post_init__(self):
        if not isinstance(self.numbers, int) or not 2 <= self.numbers <= 6:
            raise ValueError(f"numbers must be an integer in [2, 6], got {self.numbers!r}")
        if not isinstance(self.max_number, int) or self.max_number < 1:
            raise ValueError(f"max_number must be an integer >= 1, got {self.max_number!r}")
        if not isinstance(self.max_target, int) or self.max_target < 1:
            raise ValueError(f"max_target must be an integer >= 1, got {self.max_target!r}")
        if not isinstance(self.use_all, bool):
            raise ValueError(f"use_all must be a bool, got {self.use_all!r}")
        resolve_template(self.template, self._templates())
        check_grading(self.grading)

    @property
    def max_answer_chars(self) -> int:
        """Characters of the longest fully parenthesised expression over the numbers."""
        return self.numbers * len(str(self.max_number)) + 3 * (self.numbers - 1)

    def problems(self, split: str, n: int | None, seed: int) -> list[Problem]:
        """Up to `n` distinct problems of `split` ("train" or "test"), deterministic in `seed`."""
        return sample_problems(self.name, split, n, seed, self._draw)

    def prompt(self, problem: Problem) -> str:
        """The model input: the template filled with the question."""
        return render(resolve_template(self.template, self._templates()), problem.question)

    def score(self, completion: str, problem: Problem) -> float:
        """1.0 if the completion's expression obeys the rules and reaches the target, else 0.0."""
        if self.grading == "free":
            expression = free_expression(completion)
        else:
            expression = _EXPRESSION_PREFIX.match(answer_span(completion)).group(0)
        value = evaluate_expression(expression, problem.meta["numbers"], self.use_all)
        return float(value is not None and value == problem.meta["target"])

    def _templates(self) -> dict[str, str]:
        usage = "exactly once" if self.use_all else "at most once"
        return {
            "plain": "{question}\n",
            "instruct": (
                f"{{question}}, using each number {usage}, + - * / and parentheses; "
                "divisions must be exact. Put the expression in \\boxed{}."
            ),
        }

    def _draw(self, rng: random.Random) -> tuple[str, Callable[[], Problem | None]]:
        numbers = [rng.randint(1, self.max_number) for _ in range(self.numbers)]
        # The split follows the numbers alone, so the solver runs only for the wanted split.
        return str(sorted(numbers)), lambda: self._build(numbers, rng)

    def _build(self, numbers: list[int], rng: random.Random) -> Problem | None:
        reachable = solve(numbers, self.use_all)
        targets = sorted(v for v in reachable if 1 <= v <= self.max_target and v not in numbers)
        if not targets:  # rare unless max_target is tiny: the sampler skips this draw
            return None
        target = rng.choice(targets)
        solution = reachable[target]
        question = f"Make {target} with {' '.join(map(str, numbers))}"
        return Problem(
            id=problem_id(self.name, f"{sorted(numbers)}->{target}"),
            question=question,
            answer=solution,
            meta={"sft_completion": solution, "solution": solution, "numbers": numbers, "target": target},
        )


def solve(numbers: list[int], use_all: bool = False) -> dict[int, str]:
    """Every value reachable under the rules, with a shortest expression reaching it.

    Dynamic programming over subsets of the numbers (by position, so a repeated number counts
    twice): the values of a subset combine the values of each ordered split into two parts.
    """
    full = (1 << len(numbers)) - 1
    tables: dict[int, dict[int, tuple[str, int]]] = {}
    for mask in sorted(range(1, full + 1), key=lambda m: bin(m).count("1")):
        if mask & (mask - 1) == 0:
            x = numbers[mask.bit_length() - 1]
            tables[mask] = {x: (str(x), _ATOM)}
            continue
        table: dict[int, tuple[str, int]] = {}
        part = (mask - 1) & mask
        while part:
            for a, left in tables[part].items():
                for b, right in tables[mask ^ part].items():
                    for op in "+-*/":
                        value = _apply(op, a, b)
                        if value is not None:
                            _offer(table, value, left, op, right)
            part = (part - 1) & mask
        tables[mask] = table
    reachable: dict[int, tuple[str, int]] = {}
    for mask in [full] if use_all else tables:
        for value, expression in tables[mask].items():
            _keep_shorter(reachable, value, expression)
    return {value: text for value, (text, _) in reachable.items()}


def free_expression(completion: str) -> str:
    """The expression `completion` answers with by the free rule (module docstring), or ""."""
    span = free_span(completion)[0].replace("**", " ")  # markdown bold ("**(3+5)*7**"); countdown has no power operator
    for match in _EXPRESSION_CHARS.finditer(span):
        run = match.group(0)
        if _OPERATOR.search(run) and any(c.isdigit() for c in run):
            return run.replace("×", "*").replace("÷", "/").strip()
    return ""


def evaluate_expression(text: str, numbers: list[int], use_all: bool = False) -> int | None:
    """The value of `text` under the rules with the given numbers, or None if it breaks one."""
    if len(text) > _MAX_EXPRESSION_CHARS or text.strip() == "":
        return None
    tokens = _tokenize(text)
    if tokens is None:
        return None
    used = Counter(int(t) for t in tokens if t.isdigit())
    available = Counter(numbers)
    if used - available or (use_all and used != available):
        return None
    try:
        return _Parser(tokens).parse()
    except _Invalid:
        return None


class _Invalid(Exception):
    """The expression is malformed or breaks a rule."""


def _tokenize(text: str) -> list[str] | None:
    tokens, position, end = [], 0, len(text.rstrip())
    while position < end:
        match = _TOKEN.match(text, position)
        if match is None:
            return None
        number, symbol = match.groups()
        if number is not None and len(number) > 1 and number[0] == "0":
            return None
        tokens.append(number if number is not None else symbol)
        position = match.end()
    return tokens


class _Parser:
    """Recursive descent: expression = term (('+'|'-') term)*; term = factor (('*'|'/') factor)*;
    factor = number | '(' expression ')'. Evaluates as it parses."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.position, self.depth = tokens, 0, 0

    def parse(self) -> int:
        value = self._expression()
        if self.position != len(self.tokens):
            raise _Invalid
        return value

    def _peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise _Invalid
        self.position += 1
        return token

    def _binary(self, operators: str, operand) -> int:
        value = operand()
        while self._peek() is not None and self._peek() in operators:
            op = self._take()
            value = _apply(op, value, operand())
            if value is None:
                raise _Invalid
        return value

    def _expression(self) -> int:
        return self._binary("+-", self._term)

    def _term(self) -> int:
        return self._binary("*/", self._factor)

    def _factor(self) -> int:
        token = self._take()
        if token.isdigit():
            return int(token)
        if token != "(":
            raise _Invalid
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise _Invalid
        value = self._expression()
        if self._take() != ")":
            raise _Invalid
        self.depth -= 1
        return value


def _apply(op: str, a: int, b: int) -> int | None:
    """a op b on integers; None for a division that is not exact."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0 or a % b:
        return None
    return a // b


def _offer(
    table: dict[int, tuple[str, int]], value: int, left: tuple[str, int], op: str, right: tuple[str, int]
) -> None:
    """Record `left op right` for `value` if no shorter expression is known; texts carry only
    the parentheses the parse needs (operators are left-associative, so the right operand is
    wrapped unless it binds tighter). The length is checked before any text is built."""
    precedence = _PRECEDENCE[op]
    left_parens, right_parens = left[1] < precedence, right[1] <= precedence
    length = len(left[0]) + len(right[0]) + 1 + 2 * (left_parens + right_parens)
    if value in table and len(table[value][0]) <= length:
        return
    left_text = f"({left[0]})" if left_parens else left[0]
    right_text = f"({right[0]})" if right_parens else right[0]
    table[value] = (f"{left_text}{op}{right_text}", precedence)


def _keep_shorter(table: dict[int, tuple[str, int]], value: int, expression: tuple[str, int]):
    if value not in table or len(expression[0]) < len(table[value][0]):
        table[value] = expression
