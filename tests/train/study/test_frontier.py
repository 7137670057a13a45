"""sage-study's frontier view (sage_train/study/frontier.py) on a stored study: pass@1 against pass@k
per arm with crossed intervals on both axes, and the rule "better only if higher at pass@k without a
lower pass@1" against the baseline."""

import json
import re
from pathlib import Path

import pytest

from sage_train.cli import study_main
from sage_train.study.frontier import verdict

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"


def interval(low, high):
    return {"mean": (low + high) / 2, "ci_low": low, "ci_high": high}


@pytest.mark.parametrize(
    "at_k, at_1, expected",
    [
        ((0.01, 0.02), (-0.01, 0.01), "better"),  # higher at pass@k, pass@1 not lower
        ((0.01, 0.02), (0.01, 0.02), "better"),
        ((0.01, 0.02), (-0.03, -0.01), "a trade"),  # higher at pass@k for a lower pass@1
        ((-0.02, -0.01), (0.01, 0.02), "a trade"),
        ((-0.02, -0.01), (-0.01, 0.01), "worse"),
        ((-0.01, 0.01), (0.01, 0.02), "no detected difference"),  # pass@1 alone does not decide
    ],
)
def test_the_frontier_rule(at_k, at_1, expected):
    assert verdict(interval(*at_k), interval(*at_1)) == expected


def test_a_stored_studys_frontier_is_its_stored_intervals_and_the_rule(tmp_path, capsys):
    stored = json.loads((RESULTS / "confirmatory" / "study.json").read_text())
    assert study_main(["--frontier", str(RESULTS / "confirmatory"), "--k", "64", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "frontier.png").stat().st_size > 10_000
    table = (tmp_path / "frontier.md").read_text()
    rows = {
        line.split(" | ")[0][2:]: line.strip(" |").split(" | ")[1:] for line in table.splitlines() if line[:2] == "| "
    }

    def cell(entry, sign=False):
        f = "+.1f" if sign else ".1f"
        return f"{100 * entry['mean']:{f}} [{100 * entry['ci_low']:{f}}, {100 * entry['ci_high']:{f}}]"

    def direction(entry):
        return (entry["ci_low"] > 0) - (entry["ci_high"] < 0)

    assert set(rows) - {"arm"} == set(stored["arms"])
    for arm, result in stored["arms"].items():
        assert rows[arm][:2] == [cell(result["pass_at_k"]["1"]), cell(result["pass_at_k"]["64"])]
        if arm == "grpo":
            assert rows[arm][2:] == ["-", "-", "(the baseline)"]
            continue
        d1, d64 = result["diff_vs_baseline"]["1"], result["diff_vs_baseline"]["64"]
        assert rows[arm][2:4] == [cell(d1, True), cell(d64, True)]
        k, one = direction(d64), direction(d1)
        expected = "no detected difference" if k == 0 else "a trade" if k * one < 0 else ["worse", "better"][k > 0]
        assert rows[arm][4] == expected
    # stage 2's README: +40% beta +1.3 [+0.3, +2.2] at pass@64 with pass@1 +0.1 [-0.7, +0.9]; the start
    # keeps 9.5 more points of pass@64 than GRPO but has 13.1 fewer of pass@1
    assert rows["grpo-beta1.4x"][2:] == ["+0.1 [-0.7, +0.9]", "+1.3 [+0.3, +2.2]", "better"]
    assert rows["start"][4] == "a trade"
    assert "sage-study: grpo-beta1.4x: better" in capsys.readouterr().out
    assert re.search(r"## The frontier: pass@1 against pass@64, every arm against grpo", table)


def test_bad_frontier_arguments_exit_2_naming_them(tmp_path, capsys):
    for argv, message in (
        (["--frontier", str(tmp_path)], "is not a study.json"),
        (["--frontier", str(RESULTS / "confirmatory"), "--k", "0", "--out", str(tmp_path)], "--k must be in 1..eval_n"),
        (
            ["--frontier", str(RESULTS / "confirmatory"), "--baseline", "nope", "--out", str(tmp_path)],
            "baseline 'nope'",
        ),
    ):
        assert study_main(argv) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "frontier.md").exists()
