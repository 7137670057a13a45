"""``steps_per_generation``: one generation of rollouts feeds several optimizer steps (TRL's option,
the official SAGE setting is 2), the later ones off-policy, so the clipped ratio is active there;
and the token guide reads the current policy's log-probs inside the loss forward."""

import pytest
import torch
from tiny_models import completions, tiny_model

from sage_kernels import LossConfig
from sage_kernels.guides import TokenGuide
from sage_train import report
from sage_train.models.loading import build_char_tokenizer
from sage_train.policy import PolicyHead, make_batch, score
from sage_train.run import train


def test_one_generation_feeds_two_optimizer_steps(tiny_config, distributed):
    cfg = tiny_config(
        name="spg", algorithm="sage-token", steps=4, steps_per_generation=2, lr=0.05, group_size=8, max_new_tokens=6
    )
    train(cfg)
    rows = report.read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    # steps 1 and 2 learn from one generation, 3 and 4 from the next
    for key in ("reward", "reward_std", "completions/mean_length"):
        assert rows[0][key] == rows[1][key] and rows[2][key] == rows[3][key], key
    assert rows[0]["completions/mean_length"] != rows[2]["completions/mean_length"]
    # the time a generation took is logged with the step that sampled it, not again with the next
    for key in ("timing_s/generate", "timing_s/score"):
        assert rows[0][key] > 0 and rows[2][key] > 0 and rows[1][key] == 0 == rows[3][key], key
    assert all(row["timing_s/update"] > 0 for row in rows)
    # the first step of a generation is on-policy (ratio 1, nothing clipped); the second is one update
    # stale, and at this learning rate some of its tokens leave the trust region wherever a group's
    # rewards differ (clipping counts only tokens with a nonzero advantage)
    assert rows[0]["clip_ratio/region_mean"] == 0 and rows[2]["clip_ratio/region_mean"] == 0
    informative = [second for second in (1, 3) if rows[second]["frac_reward_zero_std"] < 1]
    assert informative and all(rows[second]["clip_ratio/region_mean"] > 0 for second in informative)
    # the token guide is stepped once per optimizer step: a new cycle (and bound) at every step here
    strengths = [row["guide/strength"] for row in rows]
    assert strengths == sorted(strengths, reverse=True) and len(set(strengths)) == 4


def test_the_token_guide_reads_the_current_policys_log_probs():
    """The guide is called inside the loss forward with the log-probs of that forward's own hidden
    states (the current policy), not the behaviour policy's, and its q is the one the loss uses."""
    tokenizer = build_char_tokenizer()
    head = PolicyHead(tiny_model(tokenizer, seed=4, max_positions=64))
    batch = make_batch(completions(tokenizer, 4, seed=5), torch.device("cpu"), tokenizer.pad_token_id)
    seen = {}

    class RecordingGuide(TokenGuide):
        def log_q(self, logp, entropy, mask):
            seen["logp"], seen["entropy"], seen["log_q"] = logp, entropy, super().log_q(logp, entropy, mask)
            return seen["log_q"]

    mask = batch.completion_mask
    loss_inputs = {
        "mask": mask,
        "advantages": torch.ones(4),
        "old_logp": torch.zeros(mask.shape),
        "guide": RecordingGuide(max_steps=10, seed=0),
        "ref_logp": torch.zeros(mask.shape),
        "config": LossConfig(beta=0.05),
    }
    _, out = head(**batch.model_inputs(slice(0, 4), 1.0), loss_inputs=loss_inputs)
    current, entropy = score(head, batch, 4, 1.0)
    torch.testing.assert_close(seen["logp"][mask], current[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seen["entropy"][mask], entropy[mask], rtol=1e-5, atol=1e-5)
    q = seen["log_q"].exp()[mask]
    assert q.std() > 0 and out.metrics["sage/q_mean"].item() == pytest.approx(q.mean().item(), abs=1e-5)
