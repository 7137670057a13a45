"""What a verifiable task is: problems with gold answers, a prompt template and a verifier.

Training (`sage_train.step`) and evaluation (`sage_train.eval.evaluate`) both go through this interface, so
they build prompts and grade completions the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Problem:
    """One problem: `question` is the bare problem text; `answer` the gold answer string."""

    id: str
    question: str
    answer: str
    meta: dict = field(default_factory=dict, compare=False)


class Task(Protocol):
    """A source of problems and their verifier.

    name: registry name (e.g. "arithmetic", "countdown", "knights", "math500").
    problems(split, n, seed): up to `n` problems (None: all), deterministic in `seed`.
    prompt(problem): the text given to the model (before any chat template).
    score(completion, problem): reward in [0, 1]; exact, never raises.
    """

    name: str

    def problems(self, split: str, n: int | None, seed: int) -> Sequence[Problem]: ...

    def prompt(self, problem: Problem) -> str: ...

    def score(self, completion: str, problem: Problem) -> float: ...
