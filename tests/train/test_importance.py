import math

import pytest
import torch

from sage_train.rl_maths import truncated_is_weights


def test_token_level_weights_are_truncated_ratios():
    train = torch.tensor([[math.log(0.5), math.log(0.9), 0.0]])
    rollout = torch.tensor([[math.log(0.25), math.log(0.9), -5.0]])
    mask = torch.tensor([[1, 1, 0]])
    w = truncated_is_weights(train, rollout, mask, cap=1.5)
    assert w[0].tolist() == pytest.approx([1.5, 1.0, 1.0])  # 2.0 capped; masked -> 1
    assert truncated_is_weights(train, rollout, mask, cap=3.0)[0, 0].item() == pytest.approx(2.0)


def test_sequence_level_weight_is_the_product_of_token_ratios_clamped_as_verl():
    train = torch.tensor([[math.log(2.0), math.log(3.0), 7.0], [-15.0, -10.0, 0.0]])
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    w = truncated_is_weights(train, rollout, mask, level="sequence", cap=10.0)
    assert w[0, :2].tolist() == pytest.approx([6.0] * 2)  # 2 * 3, not their geometric mean sqrt(6)
    assert w[0, 2].item() == 1.0  # masked
    assert w[1].tolist() == pytest.approx([math.exp(-20.0)] * 3)  # the sum -25 clamped to verl's -20
    assert truncated_is_weights(train, rollout, mask, level="sequence", cap=4.0)[0, 0].item() == pytest.approx(4.0)


def test_bad_arguments():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="level must be one of"):
        truncated_is_weights(x, x, x, level="group")
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(x, x, x, cap=0)
