"""The task registry: a task by name, with its options, and its grading.

`get_task("arithmetic" | "countdown" | "knights", **options)` builds a synthetic task (see
each module's docstring for its options); any other name is a math source (a benchmark name,
a jsonl path or a hub dataset id) handed to `sage_train.tasks.math.MathTask`, imported only
then so the synthetic tasks need none of its dependencies.

`grade(task, completions, problem)` is what the trainer and the evaluation call: the task's own
verifier, batched when the task can (math answers go through `sage_train.tasks.grading`'s pool).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from .arithmetic import ArithmeticTask
from .base import Problem, Task
from .countdown import CountdownTask
from .knights import KnightsTask

SYNTHETIC_TASKS = {task.name: task for task in (ArithmeticTask, CountdownTask, KnightsTask)}
TASK_NAMES = tuple(SYNTHETIC_TASKS)

__all__ = ["TASK_NAMES", "Problem", "Task", "get_task", "grade", "ArithmeticTask", "CountdownTask", "KnightsTask"]


def get_task(name: str, **options) -> Task:
    """The task called `name`, built with `options`; unknown options raise a TypeError naming them."""
    if not isinstance(name, str):
        raise TypeError(f"task name must be a string, got {name!r}")
    if not name:
        raise ValueError("task name must not be empty")
    if name in SYNTHETIC_TASKS:
        task_class = SYNTHETIC_TASKS[name]
        _check_options(name, task_class, options, positional=0)
        return task_class(**options)
    from .math import MathTask

    _check_options(name, MathTask, options, positional=1)  # its first parameter is the source
    return MathTask(name, **options)


def _check_options(name: str, factory, options: dict, positional: int) -> None:
    """Raise a TypeError listing the options `factory` does not take after its first `positional`
    parameters (nothing to check when it takes **kwargs)."""
    parameters = list(inspect.signature(factory).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    accepted = [p.name for p in parameters[positional:] if p.kind in keyword]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for task {name!r}; accepted: {accepted}")


def grade(task: Task, completions: Sequence[str], problem: Problem) -> list[float]:
    """The task's own scores of the completions of one problem (batched when the task can)."""
    score_batch = getattr(task, "score_batch", None)
    if score_batch is not None:
        return list(score_batch(list(completions), [problem] * len(completions)))
    return [task.score(text, problem) for text in completions]
