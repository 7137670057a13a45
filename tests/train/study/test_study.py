"""sage-study: a real tiny grid end to end (its stored counts read back from the evaluation
records, every interval recomputed from them, the environment and warm starts recorded), resume
reusing finished runs, a rerun of a seed reproducing its counts, bad arguments, and the guide's
share of tokens (`sage/frac_q_gt_1`) from the real loss. The interval math: test_intervals.py."""

import json
import shutil

import numpy as np
import pytest
import torch

from sage_kernels import LossConfig, fused_linear_sage_loss
from sage_train.cli import study_main
from sage_train.eval.evaluate import pass_at_k
from sage_train.step import LossTotals
from sage_train.study.intervals import crossed_interval, crossed_p_value, holm
from sage_train.study.report import recompute


def test_loss_totals_count_the_tokens_the_guide_raises():
    torch.manual_seed(0)
    B, L, H, V = 4, 6, 8, 11
    mask = torch.rand(B, L) < 0.8
    inputs = dict(
        hidden=torch.randn(B, L, H),
        weight=torch.randn(V, H),
        token_ids=torch.randint(0, V, (B, L)),
        mask=mask,
        advantages=torch.randn(B),
        ref_logp=-torch.rand(B, L),
    )
    out = fused_linear_sage_loss(**inputs, config=LossConfig(guide="branch", tau=1.5), backend="reference")
    raised = ((out.entropy > 1.5) & mask).sum() / mask.sum()
    assert 0 < raised < 1  # the threshold splits these tokens
    totals = LossTotals()
    totals.add(out.loss, out, mask)
    assert totals.metrics(1)["sage/frac_q_gt_1"] == pytest.approx(raised.item())


def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys):
    for argv in (["--seeds", "a"], ["--algorithms", "nope"], ["--eval-n", "0"], ["--lr"], ["--not_a_key=1"]):
        assert study_main([*argv, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("sage-study: ") and "\n" not in err, err
    assert study_main(["--seeds", "0"]) == 2 and "--out" in capsys.readouterr().err


def as_json(value):
    """`value` as study.json stores it (string keys; floats round-trip exactly)."""
    return json.loads(json.dumps(value))


def test_bad_endpoints_exit_2_naming_them(tmp_path, capsys):
    for endpoints in ("[{arm: nope, versus: grpo, k: [1]}]", "[{arm: grpo, versus: start, k: [0]}]", "[grpo]"):
        config = tmp_path / "study.yaml"
        config.write_text(f"algorithms: [grpo]\neval_n: 4\nendpoints: {endpoints}\n")
        assert study_main(["--config", str(config), "--out", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err.startswith("sage-study: endpoints: ")
    assert not (tmp_path / "out").exists()


def test_tiny_grid_aggregates_and_resumes(tmp_path, capsys):
    out = tmp_path / "study"
    config = tmp_path / "endpoints.yaml"
    config.write_text(
        "endpoints: [{arm: sage-branch, versus: grpo, k: [1, 4], primary: true}, {arm: grpo, versus: start, k: [4]}]\n"
    )
    argv = [
        "--config",
        str(config),
        "--algorithms",
        "grpo,sage-branch",
        "--seeds",
        "0,1",
        "--steps",
        "2",
        "--eval-n",
        "4",
        "--eval-problems",
        "5",
        "--jobs",
        "2",
        "--out",
        str(out),
        "--sft_steps=150",
        "--prompts_per_step=4",
        "--group_size=4",
        "--micro_batch_size=16",
        "--task_options={digits: 1}",
        "--max_new_tokens=4",
    ]
    assert study_main(argv) == 0
    report = json.loads((out / "study.json").read_text())
    assert {"study.md", "pass_at_k.png", "training_curves.png"} <= {p.name for p in out.iterdir()}

    def records(arm, seed):  # sage-eval's own records of (arm, seed)
        path = out / "runs" / f"{arm}-s{seed}" / "study_eval" / "records.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    assert len(report["problems"]) == 5
    for arm in ("start", "grpo", "sage-branch"):
        for seed in (0, 1):  # the stored counts are the records', in the stored problem order
            by_id = {r["problem_id"]: r for r in records(arm, seed)}
            stored = report["counts"][arm][str(seed)]
            assert stored == {"n": 4, "correct": [by_id[p]["c"] for p in report["problems"]]}
        result = report["arms"][arm]
        assert result["seeds"] == [0, 1] and sorted(result["pass_at_k"], key=int) == ["1", "2", "3", "4"]
        for k in (1, 4):
            matrix = np.array([[pass_at_k(4, c, k) for c in report["counts"][arm][s]["correct"]] for s in ("0", "1")])
            assert result["pass_at_k"][str(k)] == as_json(crossed_interval(matrix))
        if arm != "grpo":  # paired by seed and problem with the baseline (grpo)
            base = np.array([[pass_at_k(4, c, 1) for c in report["counts"]["grpo"][s]["correct"]] for s in ("0", "1")])
            own = np.array([[pass_at_k(4, c, 1) for c in report["counts"][arm][s]["correct"]] for s in ("0", "1")])
            assert result["diff_vs_baseline"]["1"] == as_json(crossed_interval(own - base))
    # the pre-registered endpoints: paired differences over both arms' seeds, in the order given
    assert [(e["arm"], e["versus"], e["k"]) for e in report["endpoints"]] == [
        ("sage-branch", "grpo", 1),
        ("sage-branch", "grpo", 4),
        ("grpo", "start", 4),
    ]
    for entry in report["endpoints"]:
        k = entry["k"]
        own, base = (
            np.array([[pass_at_k(4, c, k) for c in report["counts"][arm][s]["correct"]] for s in ("0", "1")])
            for arm in (entry["arm"], entry["versus"])
        )
        expected = {"arm": entry["arm"], "versus": entry["versus"], "k": k, "seeds": [0, 1]}
        expected.update(crossed_interval(own - base), p=crossed_p_value(own - base))
        if entry["arm"] == "sage-branch":  # the registered primaries: Holm over their two rows
            expected["primary"] = True
        assert {key: value for key, value in entry.items() if key != "p_holm"} == as_json(expected)
    primaries = report["endpoints"][:2]
    assert [e["p_holm"] for e in primaries] == pytest.approx(holm([e["p"] for e in primaries]))
    assert "p_holm" not in report["endpoints"][2]
    assert "Holm-adjusted p" in (out / "study.md").read_text()
    # a reader's recomputation from study.json alone gives every interval and p-value
    assert as_json(recompute(out / "study.json")) == {"arms": report["arms"], "endpoints": report["endpoints"]}
    # the environment: one, that trained and evaluated all 6 runs; the warm starts' SFT steps
    (env,) = report["environments"]
    assert len(env["runs"]) == 12 and env["environment"]["torch"] == torch.__version__
    assert env["environment"]["machine"]["threads"] == 1 and env["environment"]["commit"]
    for seed in ("0", "1"):
        start = report["warm_starts"][seed]
        assert start["sft_steps"] == 150
        assert start["pass_at_1"] == pytest.approx(np.mean(report["counts"]["start"][seed]["correct"]) / 4)
    curves = report["curves"]
    assert curves["grpo"]["sage/frac_q_gt_1"]["mean"] == [0.0, 0.0]  # no guide: q = 1 everywhere
    assert curves["sage-branch"]["reward"]["step"] == [1, 2] and curves["sage-branch"]["reward"]["seeds"] == 2
    assert "sage-study: [6/6]" in capsys.readouterr().out

    # the same command again: every run and evaluation is reused, the numbers are the same
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}
    assert study_main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("ok (reused)") == 6
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")} == stamps
    assert json.loads((out / "study.json").read_text())["arms"] == report["arms"]

    # seed 1 rerun from nothing (its warm start, both algorithms, their evaluations): the same counts
    for arm in ("start", "grpo", "sage-branch"):
        shutil.rmtree(out / "runs" / f"{arm}-s1")
    assert study_main(argv) == 0
    assert capsys.readouterr().out.count("ok (reused)") == 3
    assert json.loads((out / "study.json").read_text())["counts"] == report["counts"]
