"""Second derivatives (a gradient penalty): exact where supported, an error where not, never silently wrong.

The reference backend (plain autograd) and verl's `linear_cross_entropy` support them; the cpu and
triton backends form their gradients in the forward, so a penalty through them raises, naming the
way out. The vocabulary-parallel head's case is in test_vocab_parallel.py (it needs two ranks).
The refusal comes at the backward that asks for a graph (``create_graph=True``).
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_grad_close

from sage_kernels import LossConfig, fused_linear_sage_loss
from sage_kernels.integrations.verl import linear_cross_entropy
from sage_kernels.reference import reference_logprobs_and_entropy

B, L, D0, D, V = 2, 5, 4, 6, 11
CONFIGS = {
    "default": LossConfig(beta=0.04, tau=0.5),  # token-local gradient: the fused three-matmul paths
    "sequence-ratio": LossConfig(beta=0.04, tau=0.5, importance_sampling="sequence"),  # the two-pass paths
}


def _inputs(dtype):
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(B, L, generator=g) > 0.2
    mask[0, 0] = True
    return dict(
        x=torch.randn(B * L, D0, generator=g, dtype=torch.float64).to(dtype),
        proj=(torch.randn(D0, D, generator=g, dtype=torch.float64) * 0.7).to(dtype).requires_grad_(True),
        weight=(torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5).to(dtype).requires_grad_(True),
        token_ids=torch.randint(0, V, (B, L), generator=g),
        mask=mask,
        advantages=torch.randn(B, generator=g, dtype=torch.float64).float(),
        old_logp=-torch.rand(B, L, generator=g) * 2 - 1,
        ref_logp=-torch.rand(B, L, generator=g) * 2 - 1,
    )


def _model_and_loss(backend: str, dtype, config):
    """A model layer hidden = tanh(x proj) under the loss: (loss, proj, weight)."""
    t = _inputs(dtype)
    hidden = torch.tanh(t["x"] @ t["proj"]).view(B, L, D)
    out = fused_linear_sage_loss(
        hidden,
        t["weight"],
        t["token_ids"],
        t["mask"],
        t["advantages"],
        old_logp=t["old_logp"],
        ref_logp=t["ref_logp"],
        config=config,
        backend=backend,
    )
    return out.loss, t["proj"], t["weight"]


def _penalised(backend: str, dtype, config):
    """The loss's gradients with create_graph=True and a call giving the gradients of the penalty
    |d loss / d proj|^2 (on the layer below the head) with respect to proj and weight."""
    loss, proj, weight = _model_and_loss(backend, dtype, config)
    grads = torch.autograd.grad(loss, (proj, weight), create_graph=True)
    penalty = grads[0].square().sum()
    return [g.detach() for g in grads], lambda: torch.autograd.grad(penalty, (proj, weight), allow_unused=True)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_reference_second_derivative_matches_finite_differences(config):
    """The reference's penalty gradient along a random direction against a central difference."""
    t = _inputs(torch.float64)
    direction = torch.randn_like(t["weight"], generator=torch.Generator().manual_seed(5))
    _, penalty_grads = _penalised("reference", torch.float64, CONFIGS[config])
    analytic = (penalty_grads()[1] * direction).sum()

    def penalty_at(step):
        weight = (t["weight"].detach() + step * direction).requires_grad_(True)
        hidden = torch.tanh(t["x"] @ t["proj"].detach()).view(B, L, D).requires_grad_(True)
        out = fused_linear_sage_loss(
            hidden,
            weight,
            t["token_ids"],
            t["mask"],
            t["advantages"],
            old_logp=t["old_logp"],
            ref_logp=t["ref_logp"],
            config=CONFIGS[config],
            backend="reference",
        )
        # the penalty as in `_penalised`: d loss / d proj, through tanh
        (grad_hidden,) = torch.autograd.grad(out.loss, (hidden,))
        pre = t["x"] @ t["proj"].detach()
        grad_proj = t["x"].t() @ (grad_hidden.view(B * L, D) * (1 - torch.tanh(pre) ** 2))
        return grad_proj.square().sum()

    step = 1e-5
    numeric = (penalty_at(step) - penalty_at(-step)) / (2 * step)
    assert analytic.abs() > 1e-3  # a second derivative that is there to find
    torch.testing.assert_close(analytic, numeric, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_fused_backends_refuse_a_second_derivative(backend, config):
    """Refused at the backward that asks for a graph (before: the cpu backend's penalty silently lost
    the loss's share); the first derivative, without create_graph, is the reference's."""
    loss, proj, weight = _model_and_loss(backend, torch.float32, CONFIGS[config])
    with pytest.raises(RuntimeError, match=f"{backend} backend are not differentiable.*backend='reference'"):
        torch.autograd.grad(loss, (proj, weight), create_graph=True)
    want, _ = _penalised("reference", torch.float64, CONFIGS[config])
    loss, proj, weight = _model_and_loss(backend, torch.float32, CONFIGS[config])
    for g, w, name in zip(torch.autograd.grad(loss, (proj, weight)), want, ("proj", "weight")):
        assert_grad_close(g, w, torch.float32, f"{backend} {config} d loss / d {name}")


def test_verl_kernel_second_derivative_is_the_reference_one():
    t = _inputs(torch.float64)
    upstream = torch.randn(2, B * L, generator=torch.Generator().manual_seed(7), dtype=torch.float64)

    def penalty_grads(logp_and_entropy):
        hidden = torch.tanh(t["x"] @ t["proj"])
        logp, entropy = logp_and_entropy(hidden)
        objective = (logp.double() * upstream[0]).sum() + (entropy.double() * upstream[1]).sum()
        grads = torch.autograd.grad(objective, (t["proj"], t["weight"]), create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in grads), (t["proj"], t["weight"]))

    labels = t["token_ids"].view(-1)
    want = penalty_grads(
        lambda h: reference_logprobs_and_entropy(h, t["weight"], labels, temperature=0.9, dtype=torch.float64)
    )
    got = penalty_grads(lambda h: linear_cross_entropy(h, t["weight"], labels, 0.9, backend="reference"))
    for g, w, name in zip(got, want, ("proj", "weight")):
        # the adapter's backward computes in float32
        assert_grad_close(g, w, torch.float32, f"verl penalty d / d {name}")
