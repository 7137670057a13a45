"""``backend="reference"``: the oracle of `reference.py` behind the backend interface.

Every backend module exposes the same two functions:
``sage_loss(inputs: SageInputs, config: LossConfig) -> SageLossOutput`` and
``logprobs_and_entropy(hidden2d, weight, token_ids_flat, bias, temperature) -> (logp, entropy)``.
"""

from __future__ import annotations

import torch

from .reference import reference_logprobs_and_entropy, reference_sage_loss

sage_loss = reference_sage_loss


def logprobs_and_entropy(hidden2d, weight, token_ids, bias, temperature):
    dtype = torch.float64 if hidden2d.dtype == torch.float64 else torch.float32
    return reference_logprobs_and_entropy(hidden2d, weight, token_ids, bias=bias, temperature=temperature, dtype=dtype)
