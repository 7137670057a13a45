"""Group advantages: (r - mean) / (std + 1e-4) per prompt group, zero when all rewards are equal."""

import pytest
import torch

from sage_train.rl_maths import group_advantages


def test_matches_the_formula_per_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    expected = torch.stack([(row - row.mean()) / (row.std() + 1e-4) for row in rewards])
    torch.testing.assert_close(group_advantages(rewards), expected)
    assert group_advantages(rewards)[1, 3] > 0 > group_advantages(rewards)[1, 0]


def test_equal_rewards_give_exactly_zero():
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    advantages = group_advantages(rewards)
    assert torch.equal(advantages[:2], torch.zeros(2, 3))
    assert advantages[2].abs().sum() > 0


def test_unscaled_is_reward_minus_mean():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(group_advantages(rewards, scale=False), torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_rejects_groups_of_one():
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.ones(3, 1))
