"""What a Hugging Face causal LM does to its LM head's output before the softmax, as `LossConfig` options.

Gemma 2/3 softcap their logits (``final_logit_softcapping``: c tanh(a / c)), Cohere scales them
(``logit_scale``), and a few others scale them under other names. `logit_options` reads the config
keys the way TRL 1.16's fused LM head (``trl.trainer.utils.add_fused_lm_head``) reads them, so a
loss built from it computes the logits the model's own forward computes (then divided by the
sampling temperature). It needs no transformers import: it only reads attributes of the config.
"""

from __future__ import annotations


def logit_options(config) -> dict:
    """``{"logit_scale": s, "logit_softcap": c or None}`` for a transformers model config.

    The scale is the first key set among ``logit_scale`` (Cohere; None, as on MPT, reads as 1),
    ``output_multiplier``, ``lm_head_multiplier`` (Falcon-H1), then ``logits_scaling``, which
    Granite and MiniCPM3 divide by and HyperCLOVA X multiplies by. A scale of 0 is kept, and
    `LossConfig` refuses it (``logit_scale`` must be > 0).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = getattr(text, "logit_scale", None)
    for key in ("output_multiplier", "lm_head_multiplier"):
        if scale is None:
            scale = getattr(text, key, None)
    divisor = getattr(text, "logits_scaling", None)
    if scale is None and divisor is not None:
        scale = divisor if getattr(text, "model_type", None) == "hyperclovax" else 1 / divisor
    softcap = getattr(text, "final_logit_softcapping", None)
    return {
        "logit_scale": 1.0 if scale is None else float(scale),
        "logit_softcap": None if softcap is None else float(softcap),
    }
