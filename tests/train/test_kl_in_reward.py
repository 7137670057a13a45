"""``kl_in_reward``: the KL to q pi_ref moved from the loss into the reward (sage_train/rl_maths.py),
its presets, and `sage-train --algorithm=sage-branch-exact` on the tiny model."""

import pytest
import torch
import yaml
from run_copies import TINY_RUN

from sage_kernels.guides import BranchGuide, RandomGuide, TokenGuide, branch_guide
from sage_train import report, step
from sage_train.cli import train_main
from sage_train.config import ConfigError
from sage_train.inputs import run_settings
from sage_train.presets import loss_config
from sage_train.rl_maths import generation_log_q, group_advantages, objective_advantages, sequence_kl


def tensors(seed: int = 0, rows: int = 6, length: int = 5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=g) * 3
    ref = -torch.rand(rows, length, generator=g) * 3
    log_q = (torch.rand(rows, length, generator=g) - 0.5) * 0.6
    mask = torch.rand(rows, length, generator=g) < 0.7
    mask[0] = False  # a row without a completion token
    return old, ref, log_q, mask


def test_sequence_kl_is_the_masked_k1_sum_or_mean():
    old, ref, log_q, mask = tensors()
    total = sequence_kl(old, ref, log_q, mask)
    mean = sequence_kl(old, ref, log_q, mask, length_normalized=True)
    for row in range(old.shape[0]):
        terms = [
            float(old[row, t]) - float(ref[row, t]) - float(log_q[row, t]) for t in range(old.shape[1]) if mask[row, t]
        ]
        assert total[row].item() == pytest.approx(sum(terms), abs=1e-12)
        assert mean[row].item() == pytest.approx(sum(terms) / max(len(terms), 1), abs=1e-12)
    assert total[0].item() == 0.0
    plain = sequence_kl(old, ref, None, mask)
    torch.testing.assert_close(plain - total, torch.where(mask, log_q.double(), 0.0).sum(-1))


def config(**keys):
    from sage_train.config import build, resolve

    return resolve(build({**TINY_RUN, **keys}))


def run_guide(cfg):
    """The guide a run of `cfg` makes on rank 0 (as `build` does)."""
    from sage_train.guide import make_guide

    s = run_settings(cfg)
    return make_guide(s.run.guide, s.loss, s.guide, steps=s.run.steps, seed=s.run.seed, rank=0)


def test_generation_guides_are_the_guides_own():
    """Each run's guide (`make_guide`) gives the reward its q from the behaviour policy's log-probs
    and entropies: the branch guide with the run's gamma / tau / bounds, the scheduled ones their draws."""
    old, _, _, mask = tensors(1)
    entropy = torch.rand(old.shape, generator=torch.Generator().manual_seed(2)) * 3
    cfg = config(algorithm="sage-branch-exact", tau=0.8, gamma=0.5)
    q = branch_guide(entropy, gamma=0.5, tau=0.8, q_min=cfg.q_min, q_max=cfg.q_max)
    branch = run_guide(cfg)
    assert isinstance(branch, BranchGuide)
    torch.testing.assert_close(generation_log_q(branch, old, entropy, mask), torch.where(mask, q.log(), 0.0))
    assert generation_log_q(branch, old, entropy, mask)[mask].gt(0).any()  # some entropies above tau
    cfg = config(algorithm="sage-token-exact")
    expected = TokenGuide(max_steps=cfg.steps, seed=cfg.seed * 1009).log_q(old, entropy, mask)
    torch.testing.assert_close(generation_log_q(run_guide(cfg), old, entropy, mask), expected)
    cfg = config(algorithm="sage-random-exact", guide_eps_max=0.5)
    expected = RandomGuide(max_steps=cfg.steps, eps_max=0.5, seed=cfg.seed * 1009).log_q(old, entropy, mask)
    got = generation_log_q(run_guide(cfg), old, entropy, mask)
    torch.testing.assert_close(got, expected)
    assert (got[mask] != 0).any()
    cfg = config(algorithm="grpo-kl-in-reward")
    assert run_guide(cfg) is None and generation_log_q(None, old, entropy, mask) is None


def test_objective_advantages_add_the_centred_kl_to_the_task_advantages():
    """The task rewards' group advantages (scaled or not) plus -beta (c - mean c), the KL c never
    divided by a std: a group whose task rewards are all equal gets the KL part alone."""
    old, ref, _, mask = tensors(5, rows=8)
    entropy = torch.full(old.shape, 2.0)  # above tau everywhere: q = clamp(1 + 0.3 * 0.8) = 1.24
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    for normalized in (False, True):
        for scale in (True, False):
            keys = {"beta": 0.2, "kl_in_reward_length_normalized": normalized, "scale_rewards": scale}
            cfg = config(algorithm="sage-branch-exact", **keys)
            reward = run_settings(cfg).reward
            advantages, metrics = objective_advantages(reward, BranchGuide(), rewards, old, entropy, ref, mask)
            kl = sequence_kl(old, ref, torch.full(old.shape, 1.24).log(), mask, length_normalized=normalized).view(2, 4)
            kl_part = -0.2 * (kl - kl.mean(1, keepdim=True))
            expected = group_advantages(rewards, scale=scale).double() + kl_part
            torch.testing.assert_close(advantages, expected.float())
            torch.testing.assert_close(advantages[1], kl_part[1].float())  # all-equal rewards: the KL part alone
            assert kl_part[1].abs().max() > 0.01
            assert metrics["kl_in_reward/kl"].item() == pytest.approx(kl.mean().item(), rel=1e-9)
            assert metrics["kl_in_reward/penalty"].item() == pytest.approx(0.2 * kl.mean().item(), rel=1e-6)
            assert metrics["kl_in_reward/q_mean"].item() == pytest.approx(1.24, rel=1e-6)
            assert metrics["kl_in_reward/frac_q_gt_1"].item() == 1.0
            share = kl_part.abs().sum() / expected.abs().sum()
            assert metrics["kl_in_reward/kl_share"].item() == pytest.approx(share.item(), rel=1e-6)


def test_presets_put_the_kl_in_the_reward_and_none_in_the_loss():
    exact = config(algorithm="sage-branch-exact")
    assert exact.kl_in_reward and exact.guide == "branch" and exact.beta == 0.05
    assert loss_config(exact).beta == 0.0 and loss_config(exact).guide == "none"
    assert config(algorithm="grpo-kl-in-reward").guide == "none"
    assert not config(algorithm="sage-branch").kl_in_reward
    control = config(algorithm="grpo-beta1.4x")
    assert control.beta == pytest.approx(0.05 * control.q_max) and not control.kl_in_reward
    assert config(algorithm="grpo", kl_in_reward=True).kl_in_reward  # the key on its own works too


@pytest.mark.parametrize(
    "keys, word",
    [
        ({"algorithm": "sage-branch-exact", "beta": 0.0}, "'beta'"),
        ({"algorithm": "grpo", "kl_in_reward_length_normalized": True}, "'kl_in_reward_length_normalized'"),
    ],
)
def test_bad_kl_in_reward_options_name_the_key(keys, word):
    with pytest.raises(ConfigError, match=word):
        config(**keys)


def test_sage_train_runs_sage_branch_exact(tmp_path, distributed, monkeypatch):
    """Two steps from the command line; the advantages are the task's plus the centred KL part."""
    seen = []
    real = step.objective_advantages

    def recording(reward, guide, rewards, *args):
        advantages, metrics = real(reward, guide, rewards, *args)
        seen.append((rewards.clone(), advantages.clone()))
        return advantages, metrics

    monkeypatch.setattr(step, "objective_advantages", recording)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**TINY_RUN, "output_dir": str(tmp_path), "name": "exact", "steps": 2}))
    assert train_main(["--config", str(path), "--algorithm=sage-branch-exact", "--tau=0.5"]) == 0
    rows = report.read_metrics(tmp_path / "exact" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2] and len(seen) == 2
    for row, (rewards, advantages) in zip(rows, seen):
        assert row["kl"] == 0.0  # the loss has no KL term
        assert row["kl_in_reward/penalty"] == pytest.approx(0.05 * row["kl_in_reward/kl"], rel=1e-5)
        assert row["kl_in_reward/q_mean"] >= 1.0 and row["kl_in_reward/frac_q_gt_1"] > 0
        assert row["reward"] == pytest.approx(rewards.mean().item(), abs=1e-6)  # the verifier's own reward
        kl_part = advantages - group_advantages(rewards.to(advantages.device))
        torch.testing.assert_close(kl_part.sum(1), torch.zeros(kl_part.shape[0]), atol=1e-5, rtol=0)
        assert kl_part.abs().max() > 0
