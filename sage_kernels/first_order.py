"""Gradients that are not themselves differentiable: the fused backends' backward passes.

The cpu and triton backends (and the vocabulary-parallel shard sweeps built on them) form their
gradients from kernel outputs saved in the forward, so those gradients carry no graph. Under
``create_graph=True`` (a gradient penalty, a Hessian-vector product) a second derivative through
them would silently miss this loss's share. `first_order_only` makes it fail instead, at the
moment something differentiates such a gradient; a first derivative taken with ``create_graph=True``
and never differentiated again still works. torch's ``once_differentiable`` raises only when an
incoming gradient requires grad, which the constant seed of ``autograd.grad(loss, ..., create_graph=True)``
does not, so it would not catch the gradient-penalty case. The reference backend is plain autograd
through the logits and supports second derivatives, and so does verl's ``linear_cross_entropy``
(`integrations.verl`, which recomputes the reference maths in its backward). The vocabulary-parallel
head is first order on every backend: each rank differentiates through its own shard with the
others' statistics as constants, exact for the gradient but not for the gradient's derivative.
"""

from __future__ import annotations

import functools

import torch

#: the way to second derivatives for the fused backends' gradients
REFERENCE = "use backend='reference' (plain autograd through the logits) for second derivatives"
#: ... and from a vocabulary-parallel head, on any backend
SHARDED_SECOND_ORDER = "use the unsharded loss with backend='reference' for second derivatives"


class _NotDifferentiable(torch.autograd.Function):
    """A copy of `grad` joined to the graph of `anchors`, whose backward raises `message`."""

    @staticmethod
    def forward(ctx, message: str, grad: torch.Tensor, *anchors: torch.Tensor) -> torch.Tensor:
        ctx.message = message
        return grad.clone()  # a copy, not a view: callers may scale .grad in place (clipping)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(ctx.message)


def first_order_only(what: str, instead: str = REFERENCE):
    """Decorator for an autograd ``backward(ctx, *grad_outputs)`` whose gradients carry no graph.

    Without ``create_graph`` it runs as is. With it (autograd then runs backward in grad mode) the
    backward runs without grad and each gradient it returns comes back joined to the graph of the
    Function's saved tensors and incoming gradients that require grad, through a node whose own
    backward raises a RuntimeError naming `what` (whose gradients these are) and `instead` (the way
    to second derivatives). So the Function must save its differentiable inputs
    (``ctx.save_for_backward``): autograd runs a node only on a path to the tensors differentiated
    for, and the path from a gradient to those tensors runs through the inputs it depends on.
    """
    message = (
        f"sage_kernels: the gradients of the {what} are not differentiable (no double backward: a "
        f"gradient penalty or Hessian-vector product through this loss); {instead}"
    )

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grad_outputs):
            if not torch.is_grad_enabled():
                return backward(ctx, *grad_outputs)
            # read before `backward` runs: it may scale saved gradients in place
            anchors = [
                t for t in (*ctx.saved_tensors, *grad_outputs) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            return tuple(
                _NotDifferentiable.apply(message, g, *anchors) if isinstance(g, torch.Tensor) and anchors else g
                for g in grads
            )

        return wrapper

    return decorate
