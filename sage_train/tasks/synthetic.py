"""What the synthetic tasks share: seeded sampling with hash-based splits, and prompt templates.

Splits are decided by a hash of each problem's canonical key, not by the seed: one key in ten
belongs to "test", the rest to "train". So train and test never share a problem, whatever
seeds the two are drawn with. Within a split, the seed picks which problems and in what order,
and a smaller `n` gives a prefix of a larger one.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

from .base import Problem

SPLITS = ("train", "test")
DEFAULT_SIZE = 1000  # problems returned for n=None: the synthetic tasks are unbounded
_TEST_ONE_IN = 10


def _digest(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def split_of(key: str) -> str:
    """The split a problem with canonical key `key` belongs to."""
    return "test" if _digest(key) % _TEST_ONE_IN == 0 else "train"


def problem_id(task_name: str, key: str) -> str:
    """A content-based id: the same problem has the same id whatever seed drew it."""
    return f"{task_name}-{_digest(key):016x}"


def sample_problems(
    task_name: str,
    split: str,
    n: int | None,
    seed: int,
    draw: Callable[[random.Random], tuple[str, Callable[[], Problem | None]]],
) -> list[Problem]:
    """Up to `n` distinct problems of `split`, drawn with `draw(rng) -> (split_key, build)`.

    `split_key` decides the split before `build()` does the costly part (a task may split on
    less than the whole problem, e.g. countdown on its numbers). Draws of the other split are
    skipped, as are repeats (by `Problem.id`) and draws whose `build()` gives None. Fewer than
    `n` come back only when the problem space of the split runs out (a cap on the draws).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n is None:
        n = DEFAULT_SIZE
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an integer >= 0 or None, got {n!r}")
    rng = random.Random(f"{task_name}:{split}:{seed}")
    seen: set[str] = set()
    problems: list[Problem] = []
    for _ in range(100 * n + 1000):
        if len(problems) == n:
            break
        split_key, build = draw(rng)
        if split_of(split_key) != split:
            continue
        problem = build()
        if problem is not None and problem.id not in seen:
            seen.add(problem.id)
            problems.append(problem)
    return problems


def resolve_template(template: str, presets: dict[str, str]) -> str:
    """A preset name from `presets`, or a custom template containing "{question}"."""
    if template in presets:
        return presets[template]
    if "{question}" not in template:
        raise ValueError(f"template must be one of {sorted(presets)} or contain '{{question}}', got {template!r}")
    return template


def render(template: str, question: str) -> str:
    """Fill "{question}" in; plain replacement, so other braces (`\\boxed{}`) need no escaping."""
    return template.replace("{question}", question)
