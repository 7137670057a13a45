"""The branch guide and the guides table (the token and random guides and their schedule:
tests/kernels/test_official_guides.py)."""

import pytest
import torch

from sage_kernels.guides import GUIDES, BranchGuide, branch_guide


def test_branch_guide_values_and_no_gradient():
    H = torch.tensor([0.0, 1.2, 2.2, 9.0], requires_grad=True)
    q = branch_guide(H)
    assert q.tolist() == pytest.approx([1.0, 1.0, 1.3, 1.4])
    assert not q.requires_grad


def test_branch_guide_object_is_the_formula_and_asks_the_loss_for_it():
    """`BranchGuide.log_q` (the KL-in-reward path) is log `branch_guide` on valid tokens, 0 elsewhere;
    in the loss it runs as the kernels' own option, and it has no schedule or state."""
    entropy = torch.tensor([[0.5, 1.5, 3.0], [2.0, 9.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    guide = BranchGuide(gamma=0.5, tau=1.0)
    expected = torch.where(mask, branch_guide(entropy, gamma=0.5, tau=1.0).log(), 0.0)
    torch.testing.assert_close(guide.log_q(None, entropy, mask), expected)
    assert expected[0, 1] > 0 and expected[0, 2] == 0  # raised above tau; masked: q = 1
    assert guide.loss_option == "branch" and guide.schedule_values() == {} and guide.state_dict() == {}
    guide.load_state_dict(None)  # a checkpoint written when the branch guide had no object


def test_the_guides_table_names_each_guide_and_its_loss_option():
    assert set(GUIDES) == {"branch", "token", "random"}
    assert {name: kind.cls.loss_option for name, kind in GUIDES.items()} == {
        "branch": "branch",  # computed by the loss's kernels
        "token": "none",  # given to the loss as log_q
        "random": "none",
    }
    # the random guide reads nothing of the policy, so the loss skips the extra sweep for it
    assert {name: kind.cls.reads_policy for name, kind in GUIDES.items()} == {
        "branch": True,
        "token": True,
        "random": False,
    }
    # each row's settings are its constructor's keywords: what the trainer's make_guide hands it
    assert GUIDES["branch"].settings == ("gamma", "tau", "q_min", "q_max")
    schedule = {"max_steps", "num_cycles", "decay_rate", "q_min", "q_max", "seed", "sigma_max", "sigma_min"}
    assert set(GUIDES["random"].settings) == schedule | {"eps_max", "eps_min"}
    assert set(GUIDES["token"].settings) == schedule | {"alpha_max", "alpha_min", "normalization"}
