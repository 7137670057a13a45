"""The `torch-compile-chunked` peer: a GRPO loss over the LM head in chunks of tokens, in plain
PyTorch under `torch.compile`. It is what one writes without a custom kernel.

Per chunk it materialises the [chunk, V] logits, computes the loss and, when gradients are
wanted, the gradients of that chunk at once (the Liger pattern: the backward pass only
returns gradients saved by the forward). Settings: guide off (anchor pi_ref), k3 KL, PPO
clip, loss type "grpo" (mean over rows of each row's token mean), temperature 1.
"""

from __future__ import annotations

import functools

import torch

CHUNK_TOKENS = 1024


def _token_loss(logp, adv, old, ref, beta: float, eps_low: float, eps_high: float):
    """Per-token GRPO loss and its derivative in logp (guide off, k3 KL)."""
    ratio = torch.exp(logp - old)
    unclipped, clipped = ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    pg = -torch.minimum(unclipped, clipped)
    # The min picks the unclipped side where it is smaller (gradient -r*A); the clipped side
    # is a constant in logp, except inside the clip range where both sides agree.
    d_pg = torch.where(unclipped <= clipped, -unclipped, 0.0)
    delta = ref - logp
    kl = torch.expm1(delta) - delta
    return pg + beta * kl, d_pg - beta * torch.expm1(delta)


def _logits_logp(h, weight, ids):
    z = (h @ weight.t()).float()
    lse = z.logsumexp(-1)
    return z, lse, z.gather(1, ids[:, None]).squeeze(1) - lse


def _chunk_loss(h, weight, ids, w_tok, adv, old, ref, *, beta, eps_low, eps_high):
    _, _, logp = _logits_logp(h, weight, ids)
    loss_tok, _ = _token_loss(logp, adv, old, ref, beta, eps_low, eps_high)
    return (w_tok * loss_tok).sum()


def _chunk_loss_and_grads(h, weight, ids, w_tok, adv, old, ref, *, beta, eps_low, eps_high):
    z, lse, logp = _logits_logp(h, weight, ids)
    loss_tok, d_logp = _token_loss(logp, adv, old, ref, beta, eps_low, eps_high)
    g = w_tok * d_logp
    # d loss / d z = g * (onehot(y) - softmax(z))
    dz = -g[:, None] * torch.exp(z - lse[:, None])
    dz = dz.scatter_add(1, ids[:, None], g[:, None]).to(weight.dtype)
    return (w_tok * loss_tok).sum(), dz @ weight, (dz.t() @ h).float()


@functools.cache
def _chunk_fns(compiled: bool):
    fns = (_chunk_loss, _chunk_loss_and_grads)
    return tuple(torch.compile(f, dynamic=True) for f in fns) if compiled else fns


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden2d, weight, per_token, settings, compiled):
        _, loss_and_grads = _chunk_fns(compiled)
        loss = torch.zeros((), dtype=torch.float32, device=hidden2d.device)
        grad_h = torch.empty_like(hidden2d)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden2d.shape[0], CHUNK_TOKENS):
            part = slice(start, start + CHUNK_TOKENS)
            chunk_loss, chunk_gh, chunk_gw = loss_and_grads(
                hidden2d[part], weight, *(t[part] for t in per_token), **settings
            )
            loss += chunk_loss
            grad_h[part] = chunk_gh
            grad_w += chunk_gw
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None, None


def chunked_grpo_loss(
    hidden,
    weight,
    token_ids,
    mask,
    advantages,
    old_logp,
    ref_logp,
    *,
    beta: float = 0.05,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    compiled: bool = True,
) -> torch.Tensor:
    """GRPO loss of hidden [B, L, D] through weight [V, D]; gradients for hidden and weight."""
    B, L, D = hidden.shape
    m = mask.float()
    # grpo: each row's token mean, averaged over rows; folded into one weight per token.
    w_tok = (m / (m.sum(-1, keepdim=True).clamp(min=1.0) * B)).reshape(-1)
    adv = advantages.float()[:, None].expand(B, L).contiguous().reshape(-1)
    per_token = (token_ids.reshape(-1), w_tok, adv, old_logp.reshape(-1), ref_logp.reshape(-1))
    settings = {"beta": beta, "eps_low": eps_low, "eps_high": eps_high}
    hidden2d = hidden.reshape(B * L, D)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLoss.apply(hidden2d, weight, per_token, settings, compiled)
    loss_only, _ = _chunk_fns(compiled)
    return sum(
        loss_only(hidden2d[s : s + CHUNK_TOKENS], weight, *(t[s : s + CHUNK_TOKENS] for t in per_token), **settings)
        for s in range(0, B * L, CHUNK_TOKENS)
    )
