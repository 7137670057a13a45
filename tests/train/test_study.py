"""sage-study: the interval math against direct computations, a real tiny grid end to end (its
aggregated numbers recomputed from the evaluation records), resume reusing finished runs, bad
arguments, and the guide's share of tokens (`sage/frac_q_gt_1`) from the real loss."""

import json
import math
import statistics

import numpy as np
import pytest
import torch

from sage_kernels import LossConfig, fused_linear_sage_loss
from sage_train.cli import study_main
from sage_train.evaluate import pass_at_k
from sage_train.step import LossTotals
from sage_train.study_report import bootstrap_interval, interval, t_quantile


def test_t_quantile_matches_closed_forms():
    # df 1 is the Cauchy distribution, df 2 has t_p = (2p - 1) / sqrt(2 p (1 - p))
    assert t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-4)
    assert t_quantile(0.975, 2) == pytest.approx(0.95 / math.sqrt(2 * 0.975 * 0.025), rel=1e-4)
    assert t_quantile(0.975, 200) == pytest.approx(1.9719, abs=1e-3)  # near the normal's 1.96


def test_interval_is_the_wider_of_seeds_and_problems():
    rng = np.random.default_rng(1)
    matrix = rng.random((3, 40))
    result = interval(matrix)
    per_seed = matrix.mean(axis=1)
    half = t_quantile(0.975, 2) * statistics.stdev(per_seed) / math.sqrt(3)
    assert result["mean"] == pytest.approx(matrix.mean())
    assert result["ci_seeds"] == pytest.approx((per_seed.mean() - half, per_seed.mean() + half))
    assert result["ci_problems"] == pytest.approx(bootstrap_interval(matrix))
    widths = {name: result[f"ci_{name}"][1] - result[f"ci_{name}"][0] for name in ("seeds", "problems")}
    assert result["ci_source"] == max(widths, key=widths.get)
    assert result["ci_high"] - result["ci_low"] == pytest.approx(max(widths.values()))
    # identical seeds: no seed variation, so the problems decide
    same = interval(np.tile(matrix[:1], (3, 1)))
    assert same["ci_source"] == "problems" and same["ci_seeds"] == pytest.approx((same["mean"], same["mean"]))


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


def test_tiny_grid_aggregates_and_resumes(tmp_path, capsys):
    out = tmp_path / "study"
    argv = [
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

    def per_seed(arm, k):  # pass@k of each seed straight from sage-eval's records
        values = []
        for seed in (0, 1):
            records = [
                json.loads(line)
                for line in (out / "runs" / f"{arm}-s{seed}" / "study_eval" / "records.jsonl").read_text().splitlines()
            ]
            assert len(records) == 5 and all(r["n"] == 4 for r in records)
            values.append(statistics.fmean(pass_at_k(4, r["c"], k) for r in records))
        return values

    t = t_quantile(0.975, 1)
    for arm in ("start", "grpo", "sage-branch"):
        result = report["arms"][arm]
        assert result["seeds"] == [0, 1] and sorted(result["pass_at_k"], key=int) == ["1", "2", "3", "4"]
        for k in (1, 4):
            values = per_seed(arm, k)
            entry = result["pass_at_k"][str(k)]
            assert entry["mean"] == pytest.approx(statistics.fmean(values))
            mean, half = statistics.fmean(values), t * statistics.stdev(values) / math.sqrt(2)
            assert entry["ci_seeds"] == pytest.approx([mean - half, mean + half])
            assert entry["ci_low"] <= entry["mean"] <= entry["ci_high"]
        if arm != "grpo":  # paired by seed with the baseline (grpo)
            diffs = [a - b for a, b in zip(per_seed(arm, 1), per_seed("grpo", 1))]
            assert report["arms"][arm]["diff_vs_baseline"]["1"]["per_seed"] == pytest.approx(diffs)
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
