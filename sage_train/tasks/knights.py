"""Knights and knaves: knights always tell the truth, knaves always lie; who is which?

People are named A, B, C, ...; each makes one statement, written "A: <statement>." in the
question. Statements are of five kinds:
    "B is a knight" / "B is a knave"
    "B is a knight and C is a knave"      (either role on each side)
    "B is a knight or C is a knave"       (either role on each side)
    "B and C are the same kind"
    "B and C are different kinds"
A speaker may name themself. Statements are redrawn until exactly one of the 2^n
assignments of roles is consistent (a speaker is a knight iff their statement is true),
checked by enumerating all of them.

Options:
    people:   how many people, 2 to 8. Default 3.
    template: "plain" (default: the question and a newline), "instruct" (states the rules,
              asks for the answer format), or a custom string containing "{question}".
    grading:  "free" (default) or "strict", the rules of `answer.py`.

Answer, canonical form: "A=knight,B=knave,C=knight". Grading reads every "<name> <sep> <role>"
pair in the answer span, where <sep> is "=", ":", "-" or "is"/"is a"/"is an",
in any order, case and punctuation between pairs; it scores 1.0 when the pairs give every
person one role (repeating a pair is harmless), name nobody else, and match the solution.
The span, "free": that of `answer.free_span` when the answer is said explicitly (\\boxed{},
"the answer is"), else the completion's first line holding a pair (the answer first, as the
free rule reads every task). "strict": that of `answer.answer_span`.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from .answer import answer_span, check_grading, free_span
from .base import Problem
from .synthetic import problem_id, render, resolve_template, sample_problems

TEMPLATES = {
    "plain": "{question}\n",
    "instruct": (
        "Knights always tell the truth and knaves always lie. {question} "
        "Who is a knight and who is a knave? Answer like \\boxed{A=knight,B=knave}."
    ),
}
NAMES = "ABCDEFGH"
KINDS = ("is", "and", "or", "same", "different")
# Possessive quantifiers: each run of spaces is read once. With "\s*" beside "\s+is" the old pattern
# tried every split of a run between them (33 s on "a", 2000 spaces, "is", 2000 spaces; cubic).
# Nothing it could give back would match: what follows each run is a separator, "is" or a role.
_PAIR = re.compile(
    r"(?<![a-z])([a-z])(?:\s*+[=:\-]|\s++is(?:\s++an?+)?+\s)\s*+(knight|knave)(?![a-z])", re.IGNORECASE | re.ASCII
)  # ASCII: the Kelvin sign is no "k"


@dataclass(frozen=True)
class KnightsTask:
    """Seeded knights-and-knaves puzzles with exactly one solution, and their verifier."""

    people: int = 3
    template: str = "plain"
    grading: str = "free"
    name: ClassVar[str] = "knights"

    def __post_init__(self):
        if not isinstance(self.people, int) or not 2 <= self.people <= len(NAMES):
            raise ValueError(f"people must be an integer in [2, {len(NAMES)}], got {self.people!r}")
        resolve_template(self.template, TEMPLATES)
        check_grading(self.grading)

    @property
    def max_answer_chars(self) -> int:
        """Characters of the canonical answer ("A=knight," per person, less the last comma)."""
        return len("A=knight,") * self.people - 1

    def problems(self, split: str, n: int | None, seed: int) -> list[Problem]:
        """Up to `n` distinct puzzles of `split` ("train" or "test"), deterministic in `seed`."""
        return sample_problems(self.name, split, n, seed, self._draw)

    def prompt(self, problem: Problem) -> str:
        """The model input: the template filled with the question."""
        return render(resolve_template(self.template, TEMPLATES), problem.question)

    def score(self, completion: str, problem: Problem) -> float:
        """1.0 if the completion assigns every person their role in the solution, else 0.0."""
        span = free_knights_span(completion) if self.grading == "free" else answer_span(completion)
        claimed = parse_assignment(span, problem.meta["people"])
        solution = parse_assignment(problem.answer, problem.meta["people"])
        return float(claimed is not None and claimed == solution)

    def _draw(self, rng: random.Random) -> tuple[str, Callable[[], Problem]]:
        while True:
            statements = [draw_statement(rng, self.people) for _ in range(self.people)]
            solutions = consistent_assignments(statements)
            if len(solutions) == 1:
                break
        question = " ".join(f"{NAMES[i]}: {statement_text(s)}." for i, s in enumerate(statements))
        answer = format_assignment(solutions[0])
        problem = Problem(
            id=problem_id(self.name, question),
            question=question,
            answer=answer,
            meta={"sft_completion": answer, "people": self.people, "statements": [list(s) for s in statements]},
        )
        return question, lambda: problem


def draw_statement(rng: random.Random, people: int) -> tuple:
    """A random statement as a tuple: ("is", p, role) | ("and"|"or", p, role, q, role) |
    ("same"|"different", p, q), with people as indices and role True for knight."""
    kind = rng.choice(KINDS)
    if kind == "is":
        return kind, rng.randrange(people), rng.random() < 0.5
    p, q = rng.sample(range(people), 2)  # distinct, so "B or B" tautologies never arise
    if kind in ("and", "or"):
        return kind, p, rng.random() < 0.5, q, rng.random() < 0.5
    return kind, p, q


def consistent_assignments(statements: list[tuple]) -> list[tuple[bool, ...]]:
    """All role assignments under which each speaker is a knight iff their statement is true.

    All 2^n assignments are checked at once: an assignment is a bit position b (person i a
    knight iff bit i of b is set), and a statement's truth in every assignment is one integer
    whose bit b says whether it holds in assignment b.
    """
    people = len(statements)
    columns, everyone = _knight_columns(people)
    consistent = everyone
    for speaker, statement in enumerate(statements):
        consistent &= ~(_truth(statement, columns, everyone) ^ columns[speaker])
    return [tuple(bool(b >> i & 1) for i in range(people)) for b in range(1 << people) if consistent >> b & 1]


@functools.cache
def _knight_columns(people: int) -> tuple[tuple[int, ...], int]:
    """Per person, the assignments where they are a knight (as bits); and all assignments."""
    columns = tuple(sum(1 << b for b in range(1 << people) if b >> i & 1) for i in range(people))
    return columns, (1 << (1 << people)) - 1


def _truth(statement: tuple, columns: tuple[int, ...], everyone: int) -> int:
    """The assignments (as bits) in which `statement` holds."""

    def role(person: int, knight: bool) -> int:
        return columns[person] if knight else everyone & ~columns[person]

    kind = statement[0]
    if kind == "is":
        return role(statement[1], statement[2])
    if kind == "and":
        return role(statement[1], statement[2]) & role(statement[3], statement[4])
    if kind == "or":
        return role(statement[1], statement[2]) | role(statement[3], statement[4])
    differ = columns[statement[1]] ^ columns[statement[2]]
    return everyone & ~differ if kind == "same" else differ


def statement_text(statement: tuple) -> str:
    """The English form of a statement tuple (see `draw_statement`)."""
    kind = statement[0]
    if kind == "is":
        return _role_clause(statement[1], statement[2])
    if kind in ("and", "or"):
        return f"{_role_clause(statement[1], statement[2])} {kind} {_role_clause(statement[3], statement[4])}"
    p, q = NAMES[statement[1]], NAMES[statement[2]]
    return f"{p} and {q} are the same kind" if kind == "same" else f"{p} and {q} are different kinds"


def format_assignment(knights: tuple[bool, ...]) -> str:
    """The canonical answer: "A=knight,B=knave,..." in name order."""
    return ",".join(f"{NAMES[i]}={'knight' if k else 'knave'}" for i, k in enumerate(knights))


def free_knights_span(completion: str) -> str:
    """Where the free rule (module docstring) reads the roles."""
    span, explicit = free_span(completion)
    if explicit:
        return span
    return next((line for line in completion.splitlines() if _PAIR.search(line)), "")


def parse_assignment(text: str, people: int) -> tuple[bool, ...] | None:
    """The roles `text` (an answer span) assigns to the `people` persons, or None if it does not
    assign each exactly one role, or names someone else."""
    roles: dict[int, bool] = {}
    for name, role in _PAIR.findall(text):
        index = NAMES.find(name.upper())
        knight = role.lower() == "knight"
        if not 0 <= index < people or roles.setdefault(index, knight) != knight:
            return None
    if len(roles) != people:
        return None
    return tuple(roles[i] for i in range(people))


def _role_clause(person: int, knight: bool) -> str:
    return f"{NAMES[person]} is a {'knight' if knight else 'knave'}"
