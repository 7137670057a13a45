"""Guides and their schedules."""

import math

import pytest
import torch

from sage_kernels.guides import CosineRestartSchedule, RandomGuide, TokenGuide, branch_guide


def test_branch_guide_values_and_no_gradient():
    H = torch.tensor([0.0, 1.2, 2.2, 9.0], requires_grad=True)
    q = branch_guide(H)
    assert q.tolist() == pytest.approx([1.0, 1.0, 1.3, 1.4])
    assert not q.requires_grad


def test_cosine_restart_schedule():
    s = CosineRestartSchedule(start=1.0, end=0.0, period=4)
    values = [s.value(t) for t in range(9)]
    assert values[0] == pytest.approx(1.0) and values[2] == pytest.approx(0.5)
    assert values[4] == pytest.approx(1.0) and values[8] == pytest.approx(1.0)  # restarts
    assert values[1] > values[2] > values[3]
    s.step(), s.step()
    assert s.value() == pytest.approx(0.5)
    t = CosineRestartSchedule(start=1.0, end=0.0, period=4)
    t.load_state_dict(s.state_dict())
    assert t.value() == s.value()
    with pytest.raises(ValueError, match="period must be a positive int"):
        CosineRestartSchedule(1.0, 0.0, 0)


def test_token_guide_raises_q_on_surprising_tokens():
    guide = TokenGuide(gamma=0.5, tau=1.0)
    logp = torch.tensor([[math.log(0.9), math.log(0.01), -2.0]])
    mask = torch.tensor([[True, True, False]])
    q = guide(logp, mask).exp()
    assert q[0, 0].item() == pytest.approx(1.0)
    assert q[0, 1].item() == pytest.approx(min(1 + 0.5 * (-math.log(0.01) - 1.0), 1.4))
    assert q[0, 2].item() == 1.0  # masked


def test_random_guide_is_reproducible_and_resumable():
    mask = torch.ones(3, 5, dtype=torch.bool)
    a, b = RandomGuide(seed=1), RandomGuide(seed=1)
    first = a(mask)
    assert torch.equal(first, b(mask))
    assert first.exp().min() >= 0.6 - 1e-6 and first.exp().max() <= 1.4 + 1e-6
    state = a.state_dict()
    a.step()
    expected = a(mask)
    c = RandomGuide(seed=99)
    c.load_state_dict(state)
    c.step()
    assert torch.equal(c(mask), expected)
