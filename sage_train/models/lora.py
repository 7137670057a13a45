"""LoRA through `peft`, as in the official SAGE code.

With ``lora_rank > 0`` the policy is the base model plus a LoRA adapter on
``lora_target_modules``; every other weight, the LM head included, is frozen, so the fused
loss computes no LM-head gradient (its ``weight.requires_grad`` is False). The reference
policy is the same model with the adapter disabled (`AdapterDisabled`): no second copy of
the weights is kept.

A warm start (``sft_steps > 0``) trains an adapter. With ``sft_adapter: continue`` (the
official SAGE way) RL goes on training that same adapter, so the reference is the raw pre-SFT
base model; with ``merge`` it is merged into the base weights (`merge_lora`) and RL puts a fresh
adapter on the merged model, so the reference is the warm-started model, as it is without LoRA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _import_peft():
    try:
        import peft
    except ImportError as error:  # part of the [train] extra
        raise ImportError("lora_rank > 0 needs the 'peft' package: pip install peft") from error
    return peft


def apply_lora(model, *, rank: int, alpha: float, dropout: float, target_modules: list):
    """`model` wrapped as a peft model with a fresh LoRA adapter; only the adapter trains."""
    peft = _import_peft()
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        task_type="CAUSAL_LM",
        bias="none",
    )
    return peft.get_peft_model(model, config)


@dataclass(frozen=True)
class LoraSettings:
    """A run's adapter (``lora_rank`` 0: none, every weight trains), `apply_lora`'s shape."""

    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    lora_target_modules: list


def with_lora(model, lora: LoraSettings):
    """`model` with a fresh adapter shaped by a run's ``lora_*`` keys (`apply_lora`)."""
    return apply_lora(
        model,
        rank=lora.lora_rank,
        alpha=lora.lora_alpha,
        dropout=lora.lora_dropout,
        target_modules=lora.lora_target_modules,
    )


def is_lora(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def base_lm(model):
    """The causal LM under a peft wrapper (its modules hold the LoRA layers), or `model` itself."""
    return model.get_base_model() if is_lora(model) else model


def merge_lora(model):
    """The plain causal LM with the adapter merged into its weights (for a warm start)."""
    return model.merge_and_unload() if is_lora(model) else model


def merged_named_weights(model):
    """``(name, tensor)`` of `model` under the plain checkpoint's names, for saving or for
    pushing into a rollout engine. For a peft model the adapter is merged out of place,
    W + delta, so the frozen base weights are never modified: merging into them and
    unmerging after (peft's `merge_adapter` / `unmerge_adapter`) would add a rounding error
    to bf16 base weights at every sync. Under ZeRO-3 the caller gathers the parameters first.
    """
    if not is_lora(model):
        for name, param in model.named_parameters():
            yield name, param.data
        return
    layers = {}
    for name, module in model.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight") and hasattr(module, "lora_A"):
            layers[f"{name}.base_layer.weight"] = module
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        tensor = param.data
        layer = layers.get(name)
        if layer is not None:
            with torch.no_grad():
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
        yield name.removeprefix("base_model.model.").replace(".base_layer.", "."), tensor


class AdapterDisabled:
    """The reference scorer of a LoRA run: `scorer` (the policy's engine) called with the
    adapter of `peft_model` disabled, i.e. the base model's log-probs."""

    def __init__(self, scorer, peft_model) -> None:
        self.scorer, self.peft_model = scorer, peft_model

    def __call__(self, *args, **kwargs):
        with self.peft_model.disable_adapter():
            return self.scorer(*args, **kwargs)
