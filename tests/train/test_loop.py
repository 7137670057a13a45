"""The loop end to end, in-process, on a tiny real Qwen2 model with a real DeepSpeed engine:
a short run and its outputs, the presets, and resume equality after a real SIGTERM."""

import json
import math
import os
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sage_kernels.metrics import METRIC_NAMES
from sage_train import report
from sage_train.config import load_yaml
from sage_train.policy import entropy_quantiles
from sage_train.run import train

TRL_NAMES = set(METRIC_NAMES) | {
    "reward",
    "reward_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "frac_reward_zero_std",
    "loss",
    "learning_rate",
    "step_time",
}


def test_short_run_writes_every_output(tiny_config, distributed):
    cfg = tiny_config(
        name="short",
        steps=3,
        sft_steps=5,
        eval_problems=4,
        eval_samples=2,
        save_every=2,
        plots=True,
        task_options={"digits": 1, "template": "instruct"},
        max_new_tokens=6,
    )
    summary = train(cfg)
    run = cfg.run_dir
    rows = report.read_metrics(run / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert TRL_NAMES <= set(rows[0])
    for row in rows:
        assert all(isinstance(v, (int, float)) and v == v for v in row.values()), row
        q_min, q_mean, q_max = row["sage/q_min"], row["sage/q_mean"], row["sage/q_max"]
        assert 0.0 <= row["entropy/p50"] <= row["entropy/p80"] <= row["entropy/p90"] <= math.log(256) + 1e-4
        assert 0.6 - 1e-6 <= q_min <= q_mean + 1e-6 and q_mean <= q_max + 1e-6 and q_max <= 1.4 + 1e-6
        parts = [row[f"timing_s/{part}"] for part in ("generate", "score", "update")]  # every step generates here
        assert all(seconds > 0 for seconds in parts) and sum(parts) <= row["step_time"]
    assert load_yaml(run / "config.yaml") == cfg
    assert sorted(p.name for p in (run / "checkpoints").glob("step*")) == ["step000002", "step000003"]
    assert load_yaml(run / "checkpoints" / "step000003" / "config.yaml") == cfg
    assert (run / "metrics.png").stat().st_size > 0 and (run / "sft" / "config.json").is_file()
    saved = json.loads((run / "summary.json").read_text())
    assert saved["steps_done"] == 3 and not saved["interrupted"] and saved == summary
    for when in ("before", "after"):
        assert set(saved[f"eval_{when}"]) == {"train", "test"}
        for result in saved[f"eval_{when}"].values():
            assert set(result) == {"problems", "samples", "pass@1", "pass@2", "counts"} and result["problems"] == 4
            assert 0 <= result["pass@1"] <= result["pass@2"] <= 1
            assert all(n == 2 and 0 <= c <= 2 for _, n, c in result["counts"])  # what pass@k is recomputed from
            assert result["pass@1"] == sum(c for _, _, c in result["counts"]) / 8
    for split in ("train", "test"):  # the same problems before and after RL: a paired comparison
        ids = [[i for i, _, _ in saved[f"eval_{when}"][split]["counts"]] for when in ("before", "after")]
        assert ids[0] == ids[1] and len(set(ids[0])) == 4
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    assert tokenizer.decode(tokenizer("1+2=")["input_ids"]) == "1+2="
    ids = tokenizer("1+2=", return_tensors="pt")["input_ids"]
    assert ids.shape[1] < model.generate(ids, max_new_tokens=2, do_sample=False).shape[1] <= ids.shape[1] + 2


def test_entropy_quantiles_are_over_the_completion_tokens_only():
    entropy = torch.tensor([[9.0, 0.0, 1.0, 2.0], [3.0, 4.0, 9.0, 9.0]])
    mask = torch.tensor([[False, True, True, True], [True, True, False, False]])
    found = {name: float(value) for name, value in entropy_quantiles(entropy, mask).items()}
    # numpy's default (linear) quantiles of 0, 1, 2, 3, 4
    assert found == pytest.approx({"entropy/p50": 2.0, "entropy/p80": 3.2, "entropy/p90": 3.6})
    assert entropy_quantiles(entropy, torch.zeros_like(mask)) == {}


@pytest.mark.parametrize("algorithm", ["grpo", "sage-token", "sage-random", "dapo-full", "sage-branch-bnpo"])
def test_presets_run(tiny_config, distributed, algorithm):
    cfg = tiny_config(name=algorithm, algorithm=algorithm, steps=2, num_iterations=2, dynamic_sampling_max_rounds=2)
    train(cfg)
    rows = report.read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    if algorithm in ("sage-token", "sage-random"):
        assert rows[0]["guide/strength"] > rows[1]["guide/strength"]  # stepped per optimizer step
    if algorithm == "dapo-full":
        assert rows[0]["kl"] == 0.0 and 1 <= rows[0]["dynamic_sampling/rounds"] <= 2


def test_resume_after_sigterm_reproduces_the_uninterrupted_metrics(tiny_config, distributed):
    options = dict(
        steps=4,
        save_every=10,
        sft_steps=3,
        algorithm="sage-random",
        eval_problems=2,
        eval_samples=2,
        num_iterations=2,
        lr=3e-3,
    )
    whole = tiny_config(name="whole", **options)
    train(whole)

    parted = tiny_config(name="parted", **options)

    def terminate_after_step_2(step, row):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    first = train(parted, on_step=terminate_after_step_2)
    assert first["interrupted"] and first["steps_done"] == 2
    assert [r["step"] for r in report.read_metrics(parted.run_dir / "metrics.jsonl")] == [1, 2]
    second = train(tiny_config(name="parted", resume=True, **options))
    assert second["steps_done"] == 4 and not second["interrupted"]

    expected = report.read_metrics(whole.run_dir / "metrics.jsonl")
    resumed = report.read_metrics(parted.run_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(expected, resumed):
        assert report.without_timing(a) == pytest.approx(report.without_timing(b), rel=1e-6, abs=1e-7)
    # weights after 8 Adam steps at lr 3e-3: equal up to float32 summation-order noise
    final = [AutoModelForCausalLM.from_pretrained(run.run_dir / "final") for run in (whole, parted)]
    for p, q in zip(final[0].parameters(), final[1].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_resume_refuses_a_changed_config(tiny_config, distributed):
    from sage_train.config import ConfigError

    train(tiny_config(name="changed", steps=2, save_every=1))
    with pytest.raises(ConfigError, match="lr"):
        train(tiny_config(name="changed", steps=2, resume=True, lr=0.5))


def test_warm_start_stops_at_the_target_loss(tiny_config):
    from sage_train.inputs import run_settings
    from sage_train.models.loading import load_model_and_tokenizer
    from sage_train.sft import SFT_WINDOW, sft_examples, sft_warm_start
    from sage_train.tasks import get_task

    task = get_task("arithmetic", digits=1)
    problems = task.problems("train", None, 0)

    def steps_taken(cfg) -> int:
        s = run_settings(cfg)
        model, tokenizer = load_model_and_tokenizer(s.model)
        examples = sft_examples(task, problems, tokenizer, s.sft, cfg.sft_task or cfg.task)
        return sft_warm_start(model, tokenizer, examples, s.sft)

    assert steps_taken(tiny_config(sft_steps=SFT_WINDOW + 5, sft_target_loss=0.0)) == SFT_WINDOW + 5
    assert (
        steps_taken(tiny_config(sft_steps=10 * SFT_WINDOW, sft_target_loss=100.0)) == SFT_WINDOW
    )  # any loss is below it
