"""The README's figure of issue 38's primaries (sage_train/study/evidence.py): each stage's
registered primaries, read from files in each stage's own format, in order; a missing stage left out."""

import json

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
    rows = evidence.primaries(tmp_path)
    assert [(r[0].split(":")[0], r[1], r[2]) for r in rows] == [
        ("stage 0", "a - b @256", 0.03),
        ("stage 2", "grpo - start @64", -0.05),
    ]
    assert evidence.main([str(tmp_path)]) == 0 and (tmp_path / "primaries.png").stat().st_size > 1000
    assert evidence.main([str(tmp_path / "nothing")]) == 1
