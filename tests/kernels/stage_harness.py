"""The reference's per-token stage on explicit per-token values (`stage`: no vocabulary, float64), and
the relative error the float64 comparisons hold (`max_rel_err`)."""

import torch

from sage_kernels import LossConfig
from sage_kernels.inputs import validate_inputs
from sage_kernels.reference import token_stage

F64 = torch.float64


def stage(logp, entropy, mask, advantages, *, old_logp=None, ref_logp=None, is_weights=None, log_q=None, **options):
    """Run the per-token stage on explicit per-token values (no vocabulary involved)."""
    logp = torch.as_tensor(logp, dtype=F64)
    B, L = logp.shape
    config = LossConfig(**options)
    inputs = validate_inputs(
        torch.zeros(B, L, 1, dtype=F64),
        torch.zeros(1, 1, dtype=F64),
        torch.zeros(B, L, dtype=torch.long),
        torch.as_tensor(mask, dtype=torch.bool),
        torch.as_tensor(advantages, dtype=F64),
        old_logp=None if old_logp is None else torch.as_tensor(old_logp, dtype=F64),
        ref_logp=None if ref_logp is None else torch.as_tensor(ref_logp, dtype=F64),
        is_weights=None if is_weights is None else torch.as_tensor(is_weights, dtype=F64),
        log_q=None if log_q is None else torch.as_tensor(log_q, dtype=F64),
        config=config,
        allowed_dtypes=(F64,),
    )
    logp = logp.clone().requires_grad_(True)
    entropy = torch.as_tensor(entropy, dtype=F64).clone().requires_grad_(True)
    loss, per_token = token_stage(logp, entropy, inputs, config)
    return loss, per_token, logp, entropy


def max_rel_err(a, b):
    """The largest absolute difference relative to the largest entry of `b`."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()
