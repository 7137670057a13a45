"""The README's figure of issue 38's primaries (sage_train/study/evidence.py): each stage's
registered primaries, read from files in each stage's own format, in order; a missing stage left out."""

import json
from pathlib import Path

from sage_train.study import evidence


def row(mean, **extra):
    return {"mean": mean, "ci_low": mean - 0.01, "ci_high": mean + 0.01, "p": 0.01, "p_holm": 0.02, **extra}


def test_primaries_of_each_stage_in_order(tmp_path):
    (tmp_path / "toy-sampled").mkdir()
    (tmp_path / "confirmatory").mkdir()
    toy = {
        "endpoints": {
            "primary": [row(0.03, arm="a", versus="b", k=256)],
            "context": [row(-0.1, arm="g", versus="r", k=1)],
        }
    }
    (tmp_path / "toy-sampled" / "sampled.json").write_text(json.dumps(toy))
    study = {
        "endpoints": [
            row(-0.05, arm="grpo", versus="start", k=64, primary=True),
            row(0.2, arm="grpo", versus="start", k=1),  # not a primary
            {"arm": "x", "versus": "y", "k": 64, "seeds": [], "primary": True},  # no seeds yet: no row
        ]
    }
    (tmp_path / "confirmatory" / "study.json").write_text(json.dumps(study))
    (tmp_path / "frontier").mkdir()
    stage3 = {"endpoints": [row(0.08, arm="grpo-beta0.2", versus="grpo", k=64, primary=True)]}
    (tmp_path / "frontier" / "study.json").write_text(json.dumps(stage3))
    rows = evidence.primaries(tmp_path)
    assert [(r[0].split(":")[0], r[1], r[2]) for r in rows] == [
        ("stage 0", "a - b @256", 0.03),
        ("stage 2", "grpo - start @64", -0.05),
        ("stage 3", "grpo-beta0.2 - grpo @64", 0.08),
    ]
    assert evidence.main([str(tmp_path)]) == 0 and (tmp_path / "primaries.png").stat().st_size > 1000
    assert evidence.main([str(tmp_path / "nothing")]) == 1


def test_the_frontier_panel_is_the_latest_stage_with_counts():
    results = Path(__file__).resolve().parents[3] / "docs" / "results"
    stage, rows = evidence.latest_frontier(results)
    stored = json.loads((results / "confirmatory" / "study.json").read_text())["arms"]
    if (results / "frontier" / "study.json").is_file():  # stage 3, once committed
        assert stage.startswith("stage 3")
        return
    assert stage.startswith("stage 2") and [r["arm"] for r in rows] == list(stored)
    for r in rows:  # the stored intervals, at pass@1 and pass@64
        assert (r["pass_at_1"], r["pass_at_k"]) == (
            stored[r["arm"]]["pass_at_k"]["1"],
            stored[r["arm"]]["pass_at_k"]["64"],
        )
    assert {r["arm"]: r.get("verdict") for r in rows}["grpo-beta1.4x"] == "better"
