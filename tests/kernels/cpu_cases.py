"""Hostile problems for the CPU paths (`make_case`): logits from flat to confident, padded and
all-masked rows, NaN and out-of-range token ids under the mask, log-prob inputs near the policy's own."""

import math

import torch

from sage_kernels.reference import reference_logprobs_and_entropy


def make_case(
    B=3,
    L=37,
    D=96,
    V=1271,
    *,
    dtype=torch.float32,
    bias=True,
    seed=0,
    masked_rows=(1,),
    old_logp=True,
    ref_logp=True,
    is_weights=False,
    log_q=False,
    token_advantages=False,
    logit_scale=(0.05, 8.0),
):
    """Inputs whose logits range from flat to confident (per-position scale), with garbage under the mask.

    Log-prob inputs are the float64 policy's own log-probs plus noise, so ratios straddle the
    clip range and the KL is moderate; masked positions hold NaN or out-of-range token ids.
    """
    gen = torch.Generator().manual_seed(seed)
    lo, hi = math.log(logit_scale[0]), math.log(logit_scale[1])
    scale = torch.exp(lo + (hi - lo) * torch.rand(B, L, 1, generator=gen))
    hidden = (torch.randn(B, L, D, generator=gen) * scale / math.sqrt(D)).to(dtype)
    weight = torch.randn(V, D, generator=gen).to(dtype)
    mask = torch.rand(B, L, generator=gen) > 0.25
    for row in masked_rows:
        mask[row] = False
    token_ids = torch.randint(0, V, (B, L), generator=gen)
    token_ids[~mask] = V + 7  # out of range: only legal because masked
    case = dict(
        hidden=hidden,
        weight=weight,
        token_ids=token_ids,
        mask=mask,
        bias=(0.5 * torch.randn(V, generator=gen)).to(dtype) if bias else None,
        advantages=torch.randn((B, L) if token_advantages else (B,), generator=gen),
    )
    with torch.no_grad():
        logp64, _ = reference_logprobs_and_entropy(
            hidden.double().reshape(B * L, D),
            weight.double(),
            token_ids.clamp(max=V - 1).reshape(-1),
            bias=None if case["bias"] is None else case["bias"].double(),
            dtype=torch.float64,
        )
    logp64 = logp64.view(B, L).float()

    def noisy(sigma):
        return torch.where(mask, logp64 + sigma * torch.randn(B, L, generator=gen), float("nan"))

    case["old_logp"] = noisy(0.3) if old_logp else None
    case["ref_logp"] = noisy(0.5) if ref_logp else None
    case["is_weights"] = torch.rand(B, L, generator=gen) * 2 if is_weights else None
    case["log_q"] = 0.3 * torch.randn(B, L, generator=gen) if log_q else None
    return case
