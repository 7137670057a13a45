"""The coverage toy with sampled groups (sage_train/study/toy/sampled.py): its design from the
start's entropies, a tiny study written, resumed and recomputed from its stored P(correct)."""

import json
from pathlib import Path

import numpy as np
import pytest

from sage_train.study.intervals import holm
from sage_train.study.toy import enumerable as E
from sage_train.study.toy import sampled as S


def test_design_places_the_active_guide_and_matches_beta_to_its_mean_q():
    opts = S.base_options()
    plan = S.design(opts)
    quantiles, active = plan["entropy_quantiles"], plan["active_guide"]
    assert active["tau"] == pytest.approx(quantiles["0.5"])
    assert active["gamma"] * (quantiles["0.9"] - quantiles["0.5"]) == pytest.approx(opts.q_max - 1)
    assert 0.4 < active["frac_q_gt_1"] < 0.6 and active["q_mean"] > plan["paper_guide"]["q_mean"] > 1
    arms = {a["name"]: a for a in plan["arms"]}
    assert arms["grpo-beta-matched"]["beta"] == pytest.approx(opts.beta * active["q_mean"])
    assert arms["sage-branch-exact"]["way"] == "reward" and arms["sage-branch-exact"]["tau"] == active["tau"]
    # the mean q is pi_ref's visitation-weighted mean over its tokens
    toy = S._toy(opts)
    q = (1 + active["gamma"] * (E.node_entropy(toy.task.ref_logits) - active["tau"]).clamp(min=0)).clamp(0.6, 1.4)
    reach = E.visitation(toy.task, toy.ref_seq)
    assert float((q * reach).sum() / reach.sum()) == pytest.approx(active["q_mean"])


def test_a_tiny_study_is_written_resumed_and_recomputed(tmp_path):
    lines = []
    result = S.run_study(tmp_path, [7, 8], 1, S.base_options(steps=3), log=lines.append)
    assert "16 runs to do" in lines[0]
    stored = json.loads((tmp_path / "sampled.json").read_text())
    assert S.recompute(tmp_path / "sampled.json") == {k: stored[k] for k in ("endpoints", "arms", "arms_second_half")}
    primary = stored["endpoints"]["primary"]
    assert [row["k"] for row in primary] == [256, 1024]
    assert [row["p_holm"] for row in primary] == pytest.approx(holm([row["p"] for row in primary]))
    # a difference is paired by seed: its per-seed values are the arms' exact pass@k differences
    runs = stored["runs"]
    own = [S.pass_at_k(runs["sage-branch-active"][s]["p_correct"], [256])[0] for s in ("7", "8")]
    other = [S.pass_at_k(runs["grpo-beta-matched"][s]["p_correct"], [256])[0] for s in ("7", "8")]
    assert primary[0]["per_seed"] == pytest.approx(np.subtract(own, other).tolist())
    assert "Holm" in (tmp_path / "sampled.md").read_text() and (tmp_path / "pass_at_k.png").is_file()
    lines.clear()
    S.run_study(tmp_path, [7, 8], 1, S.base_options(steps=3), log=lines.append)  # resumed: nothing to run
    assert "0 runs to do" in lines[0]
    assert result["runs"]["grpo"]["7"]["p_correct"] == stored["runs"]["grpo"]["7"]["p_correct"]


def test_the_committed_stage_0_result_recomputes_from_its_probabilities():
    """docs/results/toy-sampled/sampled.json: every interval, p and Holm-adjusted p from the stored
    per-(arm, seed, prompt) P(correct), to the last digit; 30 seeds of all 8 arms, 32 prompts each."""
    path = Path(__file__).resolve().parents[4] / "docs" / "results" / "toy-sampled" / "sampled.json"
    stored = json.loads(path.read_text())
    assert json.loads(json.dumps(S.recompute(path))) == {
        k: stored[k] for k in ("endpoints", "arms", "arms_second_half")
    }
    assert all(
        len(runs) == 30 and all(len(r["p_correct"]) == 32 for r in runs.values()) for runs in stored["runs"].values()
    )
    primaries = stored["endpoints"]["primary"]
    assert [row["p_holm"] for row in primaries] == pytest.approx(holm([row["p"] for row in primaries]))
