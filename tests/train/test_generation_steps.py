"""``steps_per_generation``: one generation of rollouts feeds several optimizer steps (TRL's option,
the official SAGE setting is 2), the later ones off-policy, so the clipped ratio is active there."""

from sage_train import report
from sage_train.run import train


def test_one_generation_feeds_two_optimizer_steps(tiny_config, distributed):
    cfg = tiny_config(name="spg", algorithm="sage-token", steps=4, steps_per_generation=2, lr=0.05,
                      max_new_tokens=6)
    train(cfg)
    rows = report.read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    # steps 1 and 2 learn from one generation, 3 and 4 from the next
    for key in ("reward", "reward_std", "completions/mean_length"):
        assert rows[0][key] == rows[1][key] and rows[2][key] == rows[3][key], key
    assert rows[0]["completions/mean_length"] != rows[2]["completions/mean_length"]
    # the first step of a generation is on-policy (ratio 1, nothing clipped); the second is one update
    # stale, and at this learning rate some of its tokens leave the trust region
    assert rows[0]["clip_ratio/region_mean"] == 0 and rows[2]["clip_ratio/region_mean"] == 0
    assert rows[1]["clip_ratio/region_mean"] > 0 and rows[3]["clip_ratio/region_mean"] > 0
    # the token guide is stepped once per optimizer step: a new cycle (and bound) at every step here
    strengths = [row["guide/strength"] for row in rows]
    assert strengths == sorted(strengths, reverse=True) and len(set(strengths)) == 4
