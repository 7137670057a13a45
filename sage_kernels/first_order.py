"""Gradients that are not themselves differentiable: the fused backends' backward passes.

The cpu and triton backends (and the vocabulary-parallel shard sweeps built on them) form their
gradients from kernel outputs saved in the forward, so those gradients carry no graph: a second
derivative through them (a gradient penalty, a Hessian-vector product) would silently miss this
loss's share. `first_order_only` refuses instead, at the backward that asks for a graph
(``create_graph=True``), not at the later one that would find it missing. torch's
``once_differentiable`` defers its error to that later backward and raises only when an incoming
gradient requires grad, which the constant seed of ``autograd.grad(loss, ..., create_graph=True)``
does not: a penalty on a layer below the head went through unchecked. Refusing at once needs no
extra saved tensor to keep the raising node on autograd's path (the hidden states would be held to
the backward). The reference backend is plain autograd through the logits and supports second
derivatives, and so does verl's ``linear_cross_entropy`` (`integrations.verl`, whose backward
under ``create_graph=True`` is autograd through the reference maths). The vocabulary-parallel head
is first order on every backend: each rank differentiates through its own shard with the others'
statistics as constants, exact for the gradient but not for the gradient's derivative.
"""

from __future__ import annotations

import functools

import torch

#: the way to second derivatives for the fused backends' gradients
REFERENCE = "use backend='reference' (plain autograd through the logits) for second derivatives"
#: ... and from a vocabulary-parallel head, on any backend
SHARDED_SECOND_ORDER = "use the unsharded loss with backend='reference' for second derivatives"


def first_order_only(what: str, instead: str = REFERENCE):
    """Decorator for an autograd ``backward(ctx, *grad_outputs)`` whose gradients carry no graph:
    under ``create_graph=True`` (autograd then runs the backward in grad mode) it raises a
    RuntimeError naming `what` (whose gradients these are) and `instead` (the way to second
    derivatives); otherwise it runs the backward as is."""
    message = (
        f"sage_kernels: the gradients of the {what} are not differentiable: backward with "
        f"create_graph=True (a gradient penalty, a Hessian-vector product) is not supported; {instead}"
    )

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grad_outputs):
            if torch.is_grad_enabled():
                raise RuntimeError(message)
            return backward(ctx, *grad_outputs)

        return wrapper

    return decorate
