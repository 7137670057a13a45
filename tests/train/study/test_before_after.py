"""Before vs after RL over seeds from the runs' own evaluations (sage_train.study.before_after):
the paired (seed, problem) differences and their crossed interval, from the stored counts."""

import json

import numpy as np
import pytest

from sage_train.config import build
from sage_train.config_files import save_yaml
from sage_train.study.before_after import before_after, main
from sage_train.study.intervals import crossed_interval


def finished_run(root, seed, before, after, problems=("p0", "p1", "p2"), n=4):
    """A run directory as sage-train leaves it (the files before_after reads)."""
    run = root / f"s{seed}"
    run.mkdir()
    save_yaml(build({"seed": seed, "name": f"s{seed}"}).to_dict(), run / "config.yaml")

    def evaluation(correct):
        return {
            "test": {"problems": len(problems), "samples": n, "counts": [[p, n, c] for p, c in zip(problems, correct)]}
        }

    summary = {"wall_time_s": 600.0 + seed, "reward_first": 0.1, "reward_last": 0.4}
    summary.update(eval_before=evaluation(before), eval_after=evaluation(after))
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_after_minus_before_is_paired_per_seed_and_problem_with_the_crossed_interval(tmp_path):
    cells = {1: ([0, 1, 2], [2, 3, 2]), 2: ([1, 0, 0], [4, 1, 0]), 3: ([0, 0, 1], [1, 2, 3])}
    runs = [finished_run(tmp_path, seed, *counts) for seed, counts in cells.items()]
    result = before_after(runs, "test", [1, 4])
    diff_at_1 = np.array([[(a - b) / 4 for b, a in zip(*cells[s])] for s in (1, 2, 3)])
    expected = crossed_interval(diff_at_1)
    (at_1, at_4) = result["endpoints"]
    assert (at_1["k"], at_1["seeds"]) == (1, [1, 2, 3])
    assert at_1["mean"] == pytest.approx(diff_at_1.mean()) == pytest.approx(13 / 36)
    assert (at_1["ci_low"], at_1["ci_high"]) == pytest.approx((expected["ci_low"], expected["ci_high"]))
    # pass@4 of 4 samples: whether a problem was solved at all
    solved = lambda counts: np.array(counts) > 0  # noqa: E731
    diff_at_4 = [solved(a).astype(float) - solved(b) for b, a in cells.values()]
    assert at_4["mean"] == pytest.approx(np.mean(diff_at_4))
    assert result["counts"]["after"]["2"] == {"n": 4, "correct": [4, 1, 0]}
    assert result["runs"][0]["pass_at_k_before"]["1"] == pytest.approx(3 / 12)


def test_runs_that_cannot_be_paired_are_refused_by_name(tmp_path):
    one = finished_run(tmp_path, 1, [0, 1, 2], [1, 1, 1])
    other = finished_run(tmp_path, 2, [0, 1, 2], [1, 1, 1], problems=("p0", "p1", "q9"))
    with pytest.raises(ValueError, match="s2 evaluated other problems"):
        before_after([one, other], "test", [1])
    with pytest.raises(ValueError, match="no per-problem counts for split 'train'"):
        before_after([one], "train", [1])
    with pytest.raises(ValueError, match="k must be <= the 4 samples"):
        before_after([one], "test", [8])


def test_the_command_prints_the_table_and_keeps_every_count(tmp_path, capsys):
    runs = [finished_run(tmp_path, seed, [0, 1, 0], [2, 1, 3]) for seed in (5, 6)]
    out = tmp_path / "result.json"
    assert main([*map(str, runs), "--k", "1,2", f"--out={out}"]) == 0
    printed = capsys.readouterr().out
    assert "| 5 | 0.083 -> 0.500 |" in printed and "after - before, pass@1: +41.7 points" in printed
    assert json.loads(out.read_text())["counts"]["before"]["6"]["correct"] == [0, 1, 0]
    assert main([str(tmp_path / "missing")]) == 2
