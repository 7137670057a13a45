"""`sage-eval` end to end on tiny real models (a character-level Qwen2 saved with save_pretrained)
and a synthetic task: results.json against a regrading of the saved completions, the table and
the plot, two models in one call, run directories, and resuming an interrupted evaluation."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from tiny_models import tiny_model

from sage_train.eval.command import main
from sage_train.eval.evaluate import evaluate_engine, pass_at_k
from sage_train.models.loading import build_char_tokenizer, load_pretrained
from sage_train.rollout import SamplingParams, make_engine
from sage_train.tasks import get_task

TASK_OPTIONS = {"digits": 1}  # "3+4=" -> "7": a tiny model learns the few eval problems quickly
LIMIT = 4


def fitted_model(train_steps: int):
    """A 1-layer char-level Qwen2, fitted for `train_steps` full-batch steps to answer the first
    LIMIT test problems (so that some, not all, of its samples are right)."""
    tokenizer = build_char_tokenizer()
    model = tiny_model(tokenizer, layers=1, max_positions=64)
    task = get_task("arithmetic", **TASK_OPTIONS)
    texts = [task.prompt(p) + p.answer + tokenizer.eos_token for p in task.problems("test", LIMIT, 0)]
    batch = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(train_steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, tokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{label: saved HF directory}: an untrained model and a briefly trained one."""
    root = tmp_path_factory.mktemp("models")
    saved = {}
    for label, steps in (("untrained", 0), ("fitted", 40)):
        model, tokenizer = fitted_model(steps)
        model.save_pretrained(root / label)
        tokenizer.save_pretrained(root / label)
        saved[label] = root / label
    return saved


def run(models, out, *extra):
    return main(
        [
            "--model",
            str(models["untrained"]),
            "--model",
            str(models["fitted"]),
            "--tasks",
            "arithmetic",
            "--task-options",
            json.dumps({"arithmetic": TASK_OPTIONS}),
            "--n",
            "8",
            "--k",
            "1,2,8",
            "--seeds",
            "0,1",
            "--max-new-tokens",
            "3",
            "--out",
            str(out),
            "--no-progress",
            "--save-completions",
            *extra,
        ]
    )


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_end_to_end_results_match_the_graded_completions(models, tmp_path):
    assert run(models, tmp_path, "--limit", str(LIMIT)) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["ks"] == [1, 2, 8] and results["config"]["seeds"] == [0, 1]
    assert list(results["models"]) == ["untrained", "fitted"]
    assert results["generated"] == 2 * 2 * LIMIT and results["resumed"] == 0

    task = get_task("arithmetic", **TASK_OPTIONS)
    problems = {p.id: p for p in task.problems("test", LIMIT, 0)}
    saved = {(r["model"], r["seed"], r["problem_id"]): r for r in read_jsonl(tmp_path / "completions.jsonl")}
    for label, model in results["models"].items():
        records = model["tasks"]["arithmetic"]["problems"]
        assert sorted((r["seed"], r["problem_id"]) for r in records) == sorted(
            (seed, pid) for seed in (0, 1) for pid in problems
        )
        for record in records:
            texts = saved[(label, record["seed"], record["problem_id"])]["completions"]
            assert record["n"] == len(texts) == 8
            # c is the task's own verdict on the completions that were saved
            assert record["c"] == sum(task.score(t, problems[record["problem_id"]]) == 1.0 for t in texts)
        curve = model["tasks"]["arithmetic"]["pass_at_k"]
        for k in (1, 2, 8):
            per_seed = [sum(pass_at_k(8, r["c"], k) for r in records if r["seed"] == seed) / LIMIT for seed in (0, 1)]
            assert curve[str(k)]["per_seed"] == pytest.approx(per_seed)
            assert curve[str(k)]["mean"] == pytest.approx(sum(per_seed) / 2)
    fitted = results["models"]["fitted"]["tasks"]["arithmetic"]
    assert sum(r["c"] for r in fitted["problems"]) > 0  # the fitted model answers some right
    assert fitted["pass_at_k"]["8"]["mean"] >= fitted["pass_at_k"]["1"]["mean"]

    table = (tmp_path / "results.md").read_text()
    assert "| untrained | 4 |" in table and "| fitted | 4 |" in table and "pass@8" in table
    assert (tmp_path / "pass_at_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_skips_finished_problems(models, tmp_path):
    assert run(models, tmp_path, "--limit", "2") == 0
    first = (tmp_path / "records.jsonl").read_text()
    assert len(first.splitlines()) == 2 * 2 * 2  # models x seeds x problems
    # A kill while writing leaves a half line behind: it must be dropped, not crash the rerun.
    with open(tmp_path / "records.jsonl", "a") as f:
        f.write('{"model": "fitted", "task": "arithm')

    assert run(models, tmp_path, "--limit", str(LIMIT)) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["resumed"] == 2 * 2 * 2 and results["generated"] == 2 * 2 * 2
    records = (tmp_path / "records.jsonl").read_text()
    assert records.startswith(first)  # the finished problems were kept, not redone
    keys = [(r["model"], r["seed"], r["problem_id"]) for r in map(json.loads, records.splitlines())]
    assert len(keys) == len(set(keys)) == 2 * 2 * LIMIT
    # Their completions were not sampled again either.
    sampled = [(r["model"], r["seed"], r["problem_id"]) for r in read_jsonl(tmp_path / "completions.jsonl")]
    assert sorted(sampled) == sorted(keys)


def test_resume_refuses_other_sampling_settings(models, tmp_path):
    assert run(models, tmp_path, "--limit", "1") == 0
    with pytest.raises(ValueError, match="temperature: 1.0 there, 0.5 now"):
        run(models, tmp_path, "--limit", "1", "--temperature", "0.5")


def test_run_directory_supplies_model_task_and_output(models, tmp_path):
    run_dir = tmp_path / "runs" / "tiny-run"
    run_dir.mkdir(parents=True)
    (run_dir / "final").symlink_to(models["fitted"], target_is_directory=True)
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "task": "arithmetic",
                "task_options": TASK_OPTIONS,
                "eval_task": "",
                "max_new_tokens": 3,
                "eval_max_new_tokens": 0,
            }
        )
    )
    assert main(["--model", str(run_dir), "--n", "2", "--limit", "1", "--no-progress"]) == 0
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    assert list(results["models"]) == ["tiny-run"]
    assert results["config"]["tasks"] == ["arithmetic"]
    assert results["config"]["sampling"]["max_new_tokens"] == 3
    assert results["config"]["ks"] == [1, 2]


def test_interrupted_run_resumes_where_it_stopped(models, tmp_path):
    """Ctrl-C in a real `sage-eval` process: it exits 130 keeping what it finished, and the
    rerun samples only the rest."""
    args = [
        "--model",
        str(models["fitted"]),
        "--tasks",
        "arithmetic",
        "--task-options",
        json.dumps({"arithmetic": TASK_OPTIONS}),
        "--n",
        "64",
        "--seeds",
        "0,1,2,3,4,5,6,7,8,9,10,11",
        "--max-new-tokens",
        "3",
        "--limit",
        "16",
        "--out",
        str(tmp_path),
        "--no-progress",
    ]
    # enough work after the first records (84 problem-seeds of 64 samples) that Ctrl-C lands mid-run;
    # the child gets Ctrl-C's default action whatever this process inherited or installed
    code = f"import sys; from sage_train.cli import eval_main; sys.exit(eval_main({args!r}))"
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    process = subprocess.Popen(
        [sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint
    )
    records = tmp_path / "records.jsonl"
    deadline = time.monotonic() + 120
    while not (records.is_file() and records.read_text().count("\n") >= 2):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "rerun the same command to resume" in stderr
    finished = records.read_text().count("\n")
    total = 12 * len(get_task("arithmetic", **TASK_OPTIONS).problems("test", 16, 0))  # 1-digit sums: 7 in test
    assert 2 <= finished < total

    assert main(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["resumed"] == finished and results["generated"] == total - finished


def test_evaluate_engine_batching_and_per_problem_reproducibility(models):
    model, tokenizer = load_pretrained(str(models["fitted"]))
    engine = make_engine("hf", model, tokenizer)
    task = get_task("arithmetic", **TASK_OPTIONS)
    problems = task.problems("test", LIMIT, 0)
    common = dict(n=6, ks=[1, 6], sampling=SamplingParams(max_new_tokens=3), seeds=[0, 1])

    # One problem per call: a problem's samples do not depend on what else is evaluated.
    full = evaluate_engine(engine, task, problems, **common)
    alone = evaluate_engine(engine, task, problems[2:3], **common)
    assert [r for r in full["problems"] if r["problem_id"] == problems[2].id] == alone["problems"]

    seen = []
    batched = evaluate_engine(
        engine,
        task,
        problems,
        problems_per_call=3,
        samples_per_call=4,
        on_record=lambda record, texts, scores: seen.append((record, texts, scores)),
        **common,
    )
    assert [(r["seed"], r["problem_id"]) for r in batched["problems"]] == [
        (seed, p.id) for seed in (0, 1) for p in problems
    ]
    for record, texts, scores in seen:
        assert record["n"] == len(texts) == len(scores) == 6
        assert record["c"] == sum(s == 1.0 for s in scores)
    assert batched["generated"] == 2 * LIMIT and batched["resumed"] == 0

    with pytest.raises(ValueError, match=r"every k must be in \[1, n=6\]"):
        evaluate_engine(engine, task, problems, **common | {"ks": [8]})


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--tasks", "arithmetic", "--n", "4", "--k", "1,8"], "every k must be in [1, n=4]"),
        (["--tasks", "arithmetic", "--seeds", "a,b"], "--seeds must be comma-separated integers"),
        (["--tasks", "arithmetic", "--task-options", "{oops"], "--task-options is not valid JSON"),
        (["--tasks", "no-such-task"], "no-such-task"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(models, tmp_path, capsys, argv, named):
    from sage_train.cli import eval_main

    status = eval_main(["--model", str(models["untrained"]), "--out", str(tmp_path / "eval"), "--no-progress", *argv])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.startswith("sage-eval: ") and named in err and "\n" not in err
