"""The branch guide (the token and random guides and their schedule: tests/test_official_guides.py)."""

import pytest
import torch

from sage_kernels.guides import branch_guide


def test_branch_guide_values_and_no_gradient():
    H = torch.tensor([0.0, 1.2, 2.2, 9.0], requires_grad=True)
    q = branch_guide(H)
    assert q.tolist() == pytest.approx([1.0, 1.0, 1.3, 1.4])
    assert not q.requires_grad
