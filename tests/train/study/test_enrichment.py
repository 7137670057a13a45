"""Stage 1's screening (which seeds are chosen) and its analysis (sage_train/study/screen.py,
sage_train/study/enrichment.py) on counts built here, and the committed stage 1 result."""

import json
from pathlib import Path

import numpy as np
import pytest

from sage_train.study import enrichment as N
from sage_train.study.intervals import holm, welch
from sage_train.study.screen import selection


def test_selection_takes_the_first_of_each_kind_in_seed_order_once_the_prefix_is_screened():
    steps = {1: 1500, 2: 900, 3: 1300, 5: 800}
    assert selection(steps, [1, 2, 3, 4, 5], 1300, 2) is None  # seed 4 not screened yet
    steps[4] = 2000
    assert selection(steps, [1, 2, 3, 4, 5], 1300, 2) == {"long": [1, 3], "short": [2, 5]}
    assert selection({1: 1500, 2: 1400, 3: 100}, [1, 2, 3], 1300, 2) is None  # one short only


def report(rng, sft: dict, loss: dict) -> dict:
    """A study.json's counts: start and grpo per seed on 40 problems, n = 256."""
    counts = {"start": {}, "grpo": {}}
    for seed in sft:
        p = rng.uniform(0.002, 0.05, 40)
        counts["start"][str(seed)] = {"n": 256, "correct": rng.binomial(256, p).tolist()}
        counts["grpo"][str(seed)] = {"n": 256, "correct": rng.binomial(256, p * loss[seed]).tolist()}
    return {"counts": counts, "warm_starts": {str(s): {"sft_steps": v} for s, v in sft.items()}}


def test_analysis_splits_by_sft_length_and_adjusts_by_holm(tmp_path):
    rng = np.random.default_rng(3)
    sft = {400: 1500, 401: 900, 402: 1300, 403: 700, 404: 2000, 405: 600}
    result = N.analyse(report(rng, sft, {s: (0.3 if sft[s] >= 1300 else 1.0) for s in sft}))
    assert result["groups"] == {"long": [400, 402, 404], "short": [401, 403, 405]}
    p1, p2 = result["primary"].values()
    assert p1["mean"] < 0 and p1["seeds"] == [400, 402, 404]
    each = result["read_with"]["all seeds, pass@64"]["per_seed"]
    expected = welch([each[0], each[2], each[4]], [each[1], each[3], each[5]])
    assert p2["mean"] == pytest.approx(expected["mean"]) and p2["p"] == pytest.approx(expected["p"])
    assert [p1["p_holm"], p2["p_holm"]] == pytest.approx(holm([p1["p"], p2["p"]]))
    assert result["pearson_sft_steps_vs_premise"] < 0
    path = tmp_path / "study.json"
    path.write_text(json.dumps(report(rng, sft, dict.fromkeys(sft, 1.0))))
    again = N.recompute(path)
    assert json.loads(json.dumps(again)) == json.loads(json.dumps(N.analyse(json.loads(path.read_text()))))
    long = again["primary"]["P1 long seeds: grpo - start"]
    assert long["ci_low"] < 0 < long["ci_high"]  # no loss built in: the interval holds 0


def test_the_committed_stage_1_analysis_recomputes_from_its_counts():
    """docs/results/enrichment: enrichment.json is `recompute` of study.json's counts, to the last digit."""
    results = Path(__file__).resolve().parents[3] / "docs" / "results" / "enrichment"
    stored = json.loads((results / "enrichment.json").read_text())
    assert json.loads(json.dumps(N.recompute(results / "study.json"))) == stored
    primaries = list(stored["primary"].values())
    assert [row["p_holm"] for row in primaries] == pytest.approx(holm([row["p"] for row in primaries]))
