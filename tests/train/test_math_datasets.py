"""Math training sets on small jsonl files: the DAPO-Math-17k-Processed and OpenMathReasoning
formats, the `jsonl:` source, hub names, the system prompt in a chat template, grading of
\\boxed{} and <answer> tags, and the SFT warm start fed from `generated_solution`."""

import json

import pytest

from sage_train.config import ConfigError
from sage_train.inputs import check_inputs, held_out_problems
from sage_train.models.loading import build_char_tokenizer
from sage_train.tasks import get_task
from sage_train.tasks import math as math_tasks
from sage_train.tasks.chat import SYSTEM_PROMPTS, ChatPromptTask
from sage_train.tasks.math import answer_for_grading

DAPO_ROWS = [
    {"prompt": "What is 2 + 3?", "solution": "5"},
    {"prompt": "Compute $\\frac{1}{2} + \\frac{1}{4}$.", "solution": "\\frac{3}{4}"},
]
OMR_ROWS = [
    {"problem": "What is 3 * 4?", "expected_answer": "12", "generated_solution": "3*4 = 12, so \\boxed{12}."},
    {"problem": "What is 10 - 7?", "expected_answer": "3", "generated_solution": "10-7=3. \\boxed{3}"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dapo_format(tmp_path):
    task = get_task(str(write_jsonl(tmp_path / "dapo.jsonl", DAPO_ROWS)))
    problems = task.problems("train", None, 0)
    assert [p.question for p in problems] == [r["prompt"] for r in DAPO_ROWS]
    assert [p.answer for p in problems] == ["5", "\\frac{3}{4}"]
    assert "sft_completion" not in problems[0].meta
    assert "\\boxed{}" in task.prompt(problems[0])
    assert task.score("so the answer is \\boxed{5}", problems[0]) == 1.0
    assert task.score("<think>easy</think><answer>5</answer>", problems[0]) == 1.0
    assert task.score("\\boxed{0.75}", problems[1]) == 1.0
    assert task.score("<answer>6</answer>", problems[0]) == 0.0
    assert task.score_batch(["\\boxed{5}", "<answer>3/4</answer>"], problems) == [1.0, 1.0]


def test_openmathreasoning_format_feeds_the_warm_start(tmp_path):
    path = write_jsonl(tmp_path / "omr.data", OMR_ROWS)  # any extension after "jsonl:"
    task = get_task(f"jsonl:{path}")
    problems = task.problems("train", None, 0)
    assert [p.answer for p in problems] == ["12", "3"]
    assert [p.meta["sft_completion"] for p in problems] == [r["generated_solution"] for r in OMR_ROWS]
    assert task.score(problems[0].meta["sft_completion"], problems[0]) == 1.0


def test_missing_jsonl_and_bad_rows(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file"):
        get_task(f"jsonl:{tmp_path / 'absent.jsonl'}")
    with pytest.raises(ValueError, match="no 'problem'"):
        get_task(f"jsonl:{write_jsonl(tmp_path / 'bad.jsonl', [{'text': 'x', 'answer': '1'}])}")


@pytest.mark.parametrize(
    "name, expected",
    [
        ("dapo-math", ("open-r1/DAPO-Math-17k-Processed", "train", "en")),
        ("openmathreasoning-mini", ("unsloth/OpenMathReasoning-mini", "cot", None)),
    ],
)
def test_hub_training_sets(monkeypatch, name, expected):
    calls = []

    def fake_hub(dataset, split, config=None):
        calls.append((dataset, split, config))
        return DAPO_ROWS if name == "dapo-math" else OMR_ROWS

    monkeypatch.setattr(math_tasks, "load_hub", fake_hub)
    task = get_task(name)
    assert calls == [expected] and task.name == name and len(task.problems("train", None, 0)) == 2


def test_hub_without_datasets_says_how_to_fix(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(ImportError, match="pip install datasets"):
        get_task("dapo-math")


def test_grading_conventions():
    assert answer_for_grading("x \\boxed{1} <answer>2</answer>") == "x \\boxed{1} <answer>2</answer>"
    assert answer_for_grading("<answer>1</answer> then <answer> 2 </answer>") == "\\boxed{2}"
    assert answer_for_grading("no answer") == ""  # no number for math-verify to pick from the text
    assert answer_for_grading("So the answer is $x=2$.\nDone: 3") == "$x=2$."
    assert answer_for_grading("2 + 3 = 5, I think") == "\\boxed{5}"


def test_chat_prompt_with_system_prompt(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    task = get_task(str(write_jsonl(tmp_path / "dapo.jsonl", DAPO_ROWS)))
    chat = ChatPromptTask(task, tokenizer, "sage")
    problem = chat.problems("train", 1, 0)[0]
    text = chat.prompt(problem)
    assert text.startswith("<system>" + SYSTEM_PROMPTS["sage"]) and text.endswith("<assistant>")
    assert task.prompt(problem) in text and chat.score("\\boxed{5}", problem) == 1.0
    assert not ChatPromptTask(task, tokenizer, "").prompt(problem).startswith("<system>")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatPromptTask(task, tokenizer, "sage")


def test_warm_start_then_rl_on_openmathreasoning_jsonl(tiny_config, distributed, tmp_path):
    from sage_train.run import train

    path = write_jsonl(tmp_path / "omr.jsonl", OMR_ROWS * 2)
    cfg = tiny_config(
        name="omr",
        task=f"jsonl:{path}",
        task_options={"template": "plain"},
        sft_steps=4,
        sft_batch_size=2,
        steps=1,
        prompts_per_step=2,
        group_size=2,
        micro_batch_size=4,
        max_new_tokens=4,
    )
    summary = train(cfg)
    assert summary["steps_done"] == 1 and (cfg.run_dir / "sft" / "config.json").is_file()


def test_warm_start_on_another_dataset(tiny_config, distributed, tmp_path):
    """The Qwen2.5-Math recipe's shape: SFT on OpenMathReasoning solutions, RL on DAPO prompts."""
    from sage_train.run import train

    omr = write_jsonl(tmp_path / "omr.jsonl", OMR_ROWS)
    dapo = write_jsonl(tmp_path / "dapo.jsonl", DAPO_ROWS)
    cfg = tiny_config(
        name="sft-task",
        task=f"jsonl:{dapo}",  # no solutions: a warm start on it alone would fail
        task_options={},
        sft_task=f"jsonl:{omr}",
        sft_steps=2,
        sft_batch_size=2,
        sft_max_tokens=8,
        steps=1,
        prompts_per_step=2,
        group_size=2,
        micro_batch_size=4,
        lora_rank=2,
    )
    assert train(cfg)["steps_done"] == 1
    with pytest.raises(Exception, match="sft_completion"):
        train(
            tiny_config(
                name="no-sft",
                task=f"jsonl:{dapo}",
                task_options={},
                sft_steps=2,
                prompts_per_step=2,
                group_size=2,
                micro_batch_size=4,
            )
        )


def test_a_jsonl_tasks_held_out_split_is_not_its_rl_prompts(tmp_path, tiny_config):
    path = write_jsonl(tmp_path / "ten.jsonl", [{"problem": f"{i}+1?", "answer": str(i + 1)} for i in range(10)])
    options = dict(task=str(path), task_options={}, prompts_per_step=2, eval_splits=["test"], eval_problems=8)
    cfg = tiny_config(train_problems=6, **options)
    inputs = check_inputs(cfg, world=1)
    evaluation = inputs.settings.evaluation
    held_out = held_out_problems(evaluation, cfg.seed, cfg.task, inputs.task, inputs.train_problems)
    assert [p.id for p in held_out] == [f"ten/{i}" for i in range(6, 10)]  # the rows after the RL pool
    with pytest.raises(ConfigError, match="'test' has no held-out problem"):
        check_inputs(tiny_config(**options), world=1)


def test_a_fixed_held_out_seed_gives_every_run_seed_the_same_held_out_problems(tiny_config):
    def held_out(seed, held_out_seed):
        options = dict(task_options={"digits": 2}, eval_splits=["test"], eval_problems=16)
        cfg = tiny_config(seed=seed, held_out_seed=held_out_seed, **options)
        inputs = check_inputs(cfg, world=1)
        evaluation = inputs.settings.evaluation
        return [p.id for p in held_out_problems(evaluation, cfg.seed, cfg.task, inputs.task, inputs.train_problems)]

    assert held_out(1, 0) == held_out(2, 0) == held_out(0, None) and len(set(held_out(1, 0))) == 16
    assert held_out(1, None) != held_out(2, None)  # by default each seed draws its own
