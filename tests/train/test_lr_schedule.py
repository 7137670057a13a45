"""The one learning-rate schedule (the trainer's, the warm start's and the toy's)."""

import math

import pytest
import torch

from sage_train.optim import lr_schedule


def factors(kind: str, warmup: int, total: int) -> list:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2.0)
    schedule = lr_schedule(optimizer, kind, warmup, total)
    out = []
    for _ in range(total + 1):
        out.append(optimizer.param_groups[0]["lr"] / 2.0)
        optimizer.step()
        schedule.step()
    return out


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("constant", [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25, 0.0]),
        ("cosine", [1 / 3, 2 / 3, 1.0] + [0.5 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3, 4)]),
    ],
)
def test_warmup_then_the_decay_to_the_last_step(kind, expected):
    assert factors(kind, warmup=2, total=6) == pytest.approx(expected, abs=1e-12)
