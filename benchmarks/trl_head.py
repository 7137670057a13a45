"""The LM-head paths of TRL's GRPOTrainer as loss-benchmark providers.

``trl-chunked``: TRL 1.16's path (GRPOTrainer always installs its fused head, ``add_fused_lm_head``):
``ChunkedLogProbFunction`` over chunks of 32768 rows, asked for ``("log_probs", "entropy")`` as
GRPOTrainer asks; off Triton devices it scores every position, masked or not, as TRL does there.
``trl-full-logits``: TRL <= 1.15's path and what most trainers still do: the model returns the
[N, V] logits, ``selective_log_softmax`` takes the sampled tokens' log-probs and
``entropy_from_logits`` the entropies (a logged metric, computed on every training forward). Both
are TRL's own functions called as TRL calls them; the loss on top is GRPOTrainer's ``_compute_loss``
for the shared settings (token-level ratio, PPO clip, k3 KL against the reference, loss type grpo),
written out here because TRL only has it as a trainer method.
"""

from __future__ import annotations

import importlib

import torch

from .shapes import Inputs

#: TRL's ``_CHUNKED_LOGPROB_CHUNK_SIZE`` (trl/trainer/utils.py, 1.16).
TRL_CHUNK_ROWS = 32768


def grpo_loss(logp, mask, x: Inputs, settings: dict) -> torch.Tensor:
    """GRPOTrainer._compute_loss for token ratios, k3 KL, loss type grpo (TRL 1.16's order of terms)."""
    mask = mask.to(logp.dtype)
    advantages = x.advantages[:, None]
    coef_1 = torch.exp(logp - x.old_logp)
    coef_2 = torch.clamp(coef_1, 1 - settings["eps_low"], 1 + settings["eps_high"])
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    per_token_kl = torch.exp(x.ref_logp - logp) - (x.ref_logp - logp) - 1
    per_token_loss = per_token_loss + settings["beta"] * per_token_kl
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def full_logits(settings: dict):
    def loss(x: Inputs) -> torch.Tensor:
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

        logits = (x.hidden @ x.weight.t()) / settings["temperature"]
        logp = selective_log_softmax(logits, x.token_ids)
        entropy = entropy_from_logits(logits)
        del entropy  # a metric in TRL, computed there whatever the loss needs
        return grpo_loss(logp.float(), x.mask, x, settings)

    return loss


def chunked(settings: dict):
    def loss(x: Inputs) -> torch.Tensor:
        from trl.trainer.utils import _ChunkedLogProbFunction

        B, L, D = x.hidden.shape
        logp, entropy, *_ = _ChunkedLogProbFunction.apply(
            x.hidden.reshape(-1, D),
            x.weight,
            None,
            x.token_ids.reshape(-1),
            settings["temperature"],
            TRL_CHUNK_ROWS,
            None,
            1.0,
            ("log_probs", "entropy"),
        )
        logp = logp.view(B, L).masked_fill(~x.mask, 0)
        return grpo_loss(logp.float(), x.mask, x, settings)

    return loss


def missing(device: str) -> str | None:
    try:
        importlib.import_module("trl.trainer.utils")
    except Exception as error:
        return f"trl does not import ({type(error).__name__}: {error}); pip install 'sage-rl[trl]'"
    return None
