"""The LM-head paths of verl's fused kernels as loss-benchmark providers.

``sage-verl-kernel``: our drop-in for verl's ``linear_cross_entropy``
(`sage_kernels.integrations.verl.linear_cross_entropy`, what `patch_verl_fused_kernel` installs):
log-probs and entropies from the backend's fused shard sweep, both differentiable.
``verl-fused-linear``: verl 0.9.1's own ``FusedLinearForPPO`` as its transformers forwards build it
(``impl_backend="torch"``, chunks of 512 rows: the path verl takes without its Triton kernel).
The loss on top is the shared GRPO loss (`trl_head.grpo_loss`, the settings of `providers.SETTINGS`).
"""

from __future__ import annotations

import importlib

from sage_kernels.integrations.verl_kernel import linear_cross_entropy  # integrations.verl would import verl

from .shapes import Inputs
from .trl_head import grpo_loss


def sage_kernel(settings: dict):
    def loss(x: Inputs):
        logp, _entropy = linear_cross_entropy(x.hidden, x.weight, x.token_ids, settings["temperature"])
        return grpo_loss(logp, x.mask, x, settings)

    return loss


def verl_fused_linear(settings: dict):
    def loss(x: Inputs):
        from verl.utils.experimental.torch_functional import FusedLinearForPPO

        logp, _entropy = FusedLinearForPPO(impl_backend="torch")(
            x.hidden, x.weight, x.token_ids, temperature=settings["temperature"]
        )
        return grpo_loss(logp.float(), x.mask, x, settings)

    return loss


def missing(device: str) -> str | None:
    try:
        importlib.import_module("verl.utils.experimental.torch_functional")
    except Exception as error:
        return f"verl does not import ({type(error).__name__}: {error}); it needs ray and transformers < 5.11"
    return None
