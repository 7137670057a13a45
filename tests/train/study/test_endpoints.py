"""Where a study reads each arm's guide (sage_train/study/endpoints.py), and that every committed
study's stored intervals, p-values and Holm-adjusted p-values are what its counts give."""

import json
from pathlib import Path

import pytest

from sage_train.study.endpoints import guide_acts_in, shown_curves
from sage_train.study.intervals import holm
from sage_train.study.report import recompute

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"


def test_the_guide_is_read_where_it_acts():
    assert guide_acts_in({"algorithm": "sage-branch-exact", "tau": 0.95}) == "reward"
    assert guide_acts_in({"algorithm": "grpo-kl-in-reward"}) == "reward"
    assert guide_acts_in({"algorithm": "grpo", "kl_in_reward": True}) == "reward"
    assert guide_acts_in({"algorithm": "sage-branch"}) == "loss"
    curve = {"step": [1], "mean": [1.0], "low": [1.0], "high": [1.0], "seeds": 1}
    active = {**curve, "mean": [1.06]}
    report = {
        "study": {
            "arms": {"sage-branch-exact": {"algorithm": "sage-branch-exact"}, "old": {"algorithm": "sage-branch-exact"}}
        },
        "curves": {
            "sage-branch-exact": {"reward": curve, "sage/q_mean": curve, "kl_in_reward/q_mean": active},
            "old": {"reward": curve, "sage/q_mean": curve},  # a study run before kl_in_reward/* was kept
        },
    }
    shown = shown_curves(report)
    assert shown["sage-branch-exact"]["guide: mean q"]["mean"] == [1.06]
    assert "guide: mean q" not in shown["old"]  # not the loss's q = 1: "not recorded" in study.md


@pytest.mark.parametrize(
    "study",
    [
        "study.json",
        "arithmetic/study.json",
        "decisive/study.json",
        "kl-in-reward/study.json",
        "enrichment/study.json",
        "confirmatory/study.json",
        "frontier/study.json",
    ],
)
def test_committed_studies_recompute_exactly(study):
    stored = json.loads((RESULTS / study).read_text())
    again = json.loads(json.dumps(recompute(RESULTS / study)))
    assert again == {"arms": stored["arms"], "endpoints": stored.get("endpoints", [])}  # older studies registered none
    primaries = [row for row in again["endpoints"] if row.get("primary")]
    assert [row["p_holm"] for row in primaries] == pytest.approx(holm([row["p"] for row in primaries]))


def test_the_smollm2_before_after_result_recomputes_from_its_counts():
    from sage_train.study.endpoints import endpoint_rows

    stored = json.loads((RESULTS / "smollm2-arithmetic" / "result.json").read_text())
    rows = endpoint_rows(stored["counts"], [{"arm": "after", "versus": "before", "k": [1, 4]}])
    assert [{k: v for k, v in row.items() if k != "p"} for row in json.loads(json.dumps(rows))] == stored["endpoints"]
    assert [round(100 * x, 1) for x in rows[0]["per_seed"]] == [43.0, 40.2, 13.3]  # seeds 1, 2, 3
    assert rows[0]["p"] == pytest.approx(0.070, abs=5e-4)


def test_refresh_rewrites_a_committed_study_as_committed(tmp_path):
    """`study.refresh` on a copy of the KL-in-reward study (refreshed when p-values were added): its
    study.json and study.md come back as committed, but for the commit the refresh names."""
    import re
    import shutil

    from sage_train.study.refresh import refresh

    committed = RESULTS / "kl-in-reward"
    shutil.copytree(committed, tmp_path / "study")
    refresh(tmp_path / "study")

    def without_commit(text):
        return re.sub(r"recomputed from the counts at \S+", "", text)

    stored, again = (json.loads((d / "study.json").read_text()) for d in (committed, tmp_path / "study"))
    assert again.pop("refreshed_at_commit") and stored.pop("refreshed_at_commit")
    assert again == stored
    md = [without_commit((d / "study.md").read_text()) for d in (committed, tmp_path / "study")]
    assert md[0] == md[1]
