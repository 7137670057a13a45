"""The task registry: synthetic names, lazy routing of everything else to MathTask, option errors."""

import pytest

from sage_train.tasks import TASK_NAMES, ArithmeticTask, CountdownTask, KnightsTask, get_task


def test_synthetic_names_build_their_task_with_options():
    assert TASK_NAMES == ("arithmetic", "countdown", "knights")
    assert get_task("arithmetic", digits=3, ops="+-") == ArithmeticTask(digits=3, ops="+-")
    assert get_task("countdown", use_all=True) == CountdownTask(use_all=True)
    assert get_task("knights", people=5) == KnightsTask(people=5)
    for name in TASK_NAMES:
        assert get_task(name).name == name


def test_unknown_options_raise_type_error_naming_them():
    with pytest.raises(TypeError, match="digts") as error:
        get_task("arithmetic", digts=3, digits=2)
    assert "accepted" in str(error.value) and "digits" in str(error.value)
    with pytest.raises(TypeError, match="people"):
        get_task("countdown", people=3)


def test_bad_option_values_and_names():
    with pytest.raises(ValueError, match="people"):
        get_task("knights", people=12)
    with pytest.raises(ValueError, match="task name"):
        get_task("")
    with pytest.raises(TypeError, match="task name"):
        get_task(None)


def test_other_names_go_to_the_real_math_task():
    from sage_train.tasks.math import MathTask

    task = get_task("amc23")
    assert isinstance(task, MathTask) and len(task.problems("test", None, 0)) == 40
    with pytest.raises(TypeError, match="digits"):
        get_task("aime24", digits=2)
    with pytest.raises(TypeError, match="source"):  # the source is the name, not an option
        get_task("aime24", source="amc23")
