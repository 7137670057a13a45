"""`sage-eval --protocol official` end to end on a tiny local model with a chat template, the
prompt format read from a run directory, the pooled AIME set and the bare gold parsing."""

from __future__ import annotations

import json

import pytest
import yaml
from tiny_models import tiny_model

from sage_train.eval.command import main
from sage_train.eval.models import resolve_models
from sage_train.eval.settings import build_parser, prompt_format
from sage_train.models.loading import build_char_tokenizer
from sage_train.tasks import get_task
from sage_train.tasks.chat import OFFICIAL_CHAT_TEMPLATE


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A run directory whose tiny model was trained in the official format (template saved)."""
    run = tmp_path_factory.mktemp("runs") / "official-run"
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = OFFICIAL_CHAT_TEMPLATE
    tiny_model(tokenizer, layers=1, max_positions=64).save_pretrained(run / "final")
    tokenizer.save_pretrained(run / "final")
    (run / "config.yaml").write_text(
        yaml.safe_dump(
            {"task": "arithmetic", "chat_template": "official", "system_prompt": "official", "max_new_tokens": 3}
        )
    )
    return run


def test_official_protocol_end_to_end(chat_model, tmp_path, math_data):
    out = tmp_path / "eval"
    assert (
        main(
            [
                "--model",
                str(chat_model / "final"),
                "--protocol",
                "official",
                "--limit",
                "2",
                "--n",
                "2",
                "--max-new-tokens",
                "3",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    config = results["config"]
    assert config["tasks"] == ["aime", "amc23", "math500"] and config["ks"] == [1, 2]
    sampling = config["sampling"]
    assert (sampling["temperature"], sampling["top_p"], sampling["max_new_tokens"], sampling["stop"]) == (
        0.3,
        0.95,
        3,
        [],
    )
    assert config["prompt_format"] == {"official-run": {"chat_template": "official", "system_prompt": "official"}}
    model = results["models"]["official-run"]
    for k in ("1", "2"):
        means = [model["tasks"][t]["pass_at_k"][k]["mean"] for t in ("aime", "amc23", "math500")]
        assert model["average"][k] == pytest.approx(sum(means) / 3)
    table = (out / "results.md").read_text()
    assert "### aime" in table and "### average (aime, amc23, math500)" in table
    assert len(model["tasks"]["aime"]["problems"]) == 2


def test_prompt_format_defaults_to_the_trained_one(chat_model):
    parse = build_parser().parse_args
    [model] = resolve_models([str(chat_model)])
    assert prompt_format(parse(["--model", "x"]), model) == ("official", "official")
    assert prompt_format(parse(["--model", "x", "--chat-template", "", "--system-prompt", ""]), model) == ("", "")
    [bare] = resolve_models(["some-org/some-hub-model"])
    assert prompt_format(parse(["--model", "x"]), bare) == ("", "")
    assert prompt_format(parse(["--model", "x", "--protocol", "official"]), bare) == ("tokenizer", "official")


def test_official_prompt_through_the_template(chat_model, math_data):
    from transformers import AutoTokenizer

    from sage_train.tasks.chat import SYSTEM_PROMPTS, ChatPromptTask

    task = get_task("amc23", template="official", gold_parsing="bare")
    chat = ChatPromptTask(task, AutoTokenizer.from_pretrained(chat_model / "final"), "official", "tokenizer")
    problem = task.problems("test", 1, 0)[0]
    assert chat.prompt(problem) == (
        SYSTEM_PROMPTS["official"]
        + "<eos>Problem: "
        + problem.question
        + "\n\nSolve this step by step and provide your final numerical answer."
        + "<start_working_out>"
    )


def test_pooled_aime_and_bare_gold_parsing(math_data):
    aime = get_task("aime").problems("test", None, 0)
    parts = get_task("aime24").problems("test", None, 0) + get_task("aime25").problems("test", None, 0)
    assert len(aime) == 60 and [p.question for p in aime] == [p.question for p in parts]
    assert [p.id for p in aime] == [f"aime/{i}" for i in range(60)]
    from sage_train.tasks.base import Problem

    problem = Problem(id="x", question="?", answer="3\\sqrt{13}")
    completion = "so the answer is \\boxed{3\\sqrt{13}}"
    assert get_task("amc23").score(completion, problem) == 1.0  # boxed gold: the whole answer
    assert get_task("amc23", gold_parsing="bare").score(completion, problem) == 0.0  # bare: a number only
    with pytest.raises(ValueError, match="gold_parsing"):
        get_task("amc23", gold_parsing="wrapped")


def test_options_and_their_command_line_give_the_same_settings(chat_model, tmp_path):
    """Code calls sage-eval through `options` (the study does); the command line it logs parses back
    to the same options, and both resolve to the same settings."""
    import shlex

    from sage_train.eval.settings import command_line, options, resolve_settings

    args = options(
        model=[str(chat_model)],  # a run directory: its config gives the length
        tasks="arithmetic",
        task_options='{"arithmetic": {"digits": 2}}',
        n=4,
        k="1,3",
        seeds="5",
        limit=3,
        temperature=0.7,
        out=str(tmp_path / "an eval"),
        no_progress=True,
    )
    line = command_line(args)
    assert line.startswith("sage-eval --model ") and "--n 4" in line and "'an eval'" not in line.split("--out")[0]
    assert vars(build_parser().parse_args(shlex.split(line)[1:])) == vars(args)
    settings = resolve_settings(args)
    assert (settings.n, settings.ks, settings.seeds, settings.limit) == (4, [1, 3], [5], 3)
    assert settings.sampling.temperature == 0.7 and settings.sampling.max_new_tokens == 3  # the run's
    assert [len(p) for p in settings.problems.values()] == [3] and not settings.progress
    with pytest.raises(TypeError, match="unknown sage-eval option"):
        options(samples=3)
