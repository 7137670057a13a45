"""What every synthetic task promises: seeded, split-disjoint problems whose gold completion
scores 1 and whose verifier never raises."""

import dataclasses

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from sage_train.tasks import ArithmeticTask, CountdownTask, KnightsTask
from sage_train.tasks.synthetic import DEFAULT_SIZE, sample_problems

TASKS = {
    "arithmetic": ArithmeticTask(),
    "arithmetic-mixed": ArithmeticTask(digits=3, ops="+-*", operands=3),
    "countdown": CountdownTask(),
    "countdown-use-all": CountdownTask(numbers=4, max_number=20, max_target=200, use_all=True),
    "knights": KnightsTask(),
    "knights-8": KnightsTask(people=8),
}
ids = list(TASKS)


def fingerprint(problems):
    return [(p.id, p.question, p.answer, p.meta) for p in problems]


@pytest.fixture(params=ids)
def task(request):
    return TASKS[request.param]


def test_same_seed_same_problems_and_smaller_n_is_a_prefix(task):
    first = task.problems("train", 30, seed=7)
    assert len(first) == 30
    assert fingerprint(first) == fingerprint(task.problems("train", 30, seed=7))
    assert fingerprint(task.problems("train", 10, seed=7)) == fingerprint(first[:10])
    assert fingerprint(first) != fingerprint(task.problems("train", 30, seed=8))


def test_problems_are_distinct_and_splits_disjoint_whatever_the_seeds(task):
    train = [p for seed in (0, 1) for p in task.problems("train", 40, seed)]
    test = [p for seed in (0, 1) for p in task.problems("test", 40, seed)]
    for split in (train[:40], train[40:], test[:40], test[40:]):
        assert len({p.id for p in split}) == len({p.question for p in split}) == len(split)
    assert not {p.id for p in train} & {p.id for p in test}
    assert not {p.question for p in train} & {p.question for p in test}


def test_countdown_splits_never_share_numbers():
    task = TASKS["countdown"]
    numbers = {
        split: {tuple(sorted(p.meta["numbers"])) for p in task.problems(split, 60, seed=0)}
        for split in ("train", "test")
    }
    assert not numbers["train"] & numbers["test"]


def test_gold_completion_scores_one_and_prompts_are_plain_ascii(task):
    for problem in task.problems("test", 20, seed=0):
        completion = problem.meta["sft_completion"]
        assert task.score(completion, problem) == 1.0
        assert len(completion) <= task.max_answer_chars
        prompt = task.prompt(problem)
        assert prompt.isascii() and prompt.startswith(problem.question)


@pytest.mark.parametrize("name", ids)
@given(junk=st.text(max_size=40))
def test_gold_then_a_new_line_of_anything_scores_one_under_the_strict_rule(name, junk):
    assume("boxed{" not in junk and "answer" not in junk.lower())
    task = dataclasses.replace(TASKS[name], grading="strict")
    problem = task.problems("train", 1, seed=0)[0]
    assert task.score(problem.meta["sft_completion"] + "\n" + junk, problem) == 1.0


@pytest.mark.parametrize("name", ids)
@given(text=st.text(max_size=80))
def test_any_text_is_graded_without_error(name, text):
    task = TASKS[name]
    problem = task.problems("train", 1, seed=0)[0]
    assert task.score(text, problem) in (0.0, 1.0)


@pytest.mark.parametrize(
    "name, alphabet",
    [
        ("arithmetic", "+-*/=()., \n\\{}abcxyzAnswer:"),
        ("countdown", "+-*/=()., \n\\{}abcxyzAnswer:"),
        ("knights", "ABCDEFGH=:,;.- \n\\{}isantvIS"),  # no "k": neither role can be named
    ],
)
@given(data=st.data())
def test_malformed_completions_score_zero(name, alphabet, data):
    text = data.draw(st.text(alphabet=alphabet, max_size=60))
    task = TASKS[name]
    problem = task.problems("train", 1, seed=0)[0]
    assert task.score(text, problem) == 0.0


def test_sampler_rejects_bad_arguments():
    task = TASKS["arithmetic"]
    with pytest.raises(ValueError, match="split"):
        task.problems("validation", 5, seed=0)
    with pytest.raises(ValueError, match="n must"):
        task.problems("train", -1, seed=0)
    assert len(task.problems("train", 0, seed=0)) == 0


def test_n_none_gives_the_default_size_and_small_spaces_run_out():
    assert len(ArithmeticTask().problems("train", None, seed=0)) == DEFAULT_SIZE
    # 1-digit addition has 100 problems in all, about 10 of them in "test".
    tiny = ArithmeticTask(digits=1).problems("test", 50, seed=0)
    assert 0 < len(tiny) < 25
    assert len(sample_problems("x", "train", 3, 0, lambda rng: ("key", lambda: None))) == 0
