"""LoRA through `peft`, as in the official SAGE code.

With ``lora_rank > 0`` the policy is the base model plus a LoRA adapter on
``lora_target_modules``; every other weight, the LM head included, is frozen, so the fused
loss computes no LM-head gradient (its ``weight.requires_grad`` is False). The reference
policy is the same model with the adapter disabled (`AdapterDisabled`): no second copy of
the weights is kept.

A warm start (``sft_steps > 0``) trains an adapter of its own, which is then merged into the
base weights (`merge_lora`); RL puts a fresh adapter on the merged model, so the reference
is the warm-started model, as it is without LoRA.
"""

from __future__ import annotations

from contextlib import contextmanager

#: the attention and MLP projections of Llama / Qwen2-style models
DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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


def is_lora(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def base_lm(model):
    """The causal LM under a peft wrapper (its modules hold the LoRA layers), or `model` itself."""
    return model.get_base_model() if is_lora(model) else model


def merge_lora(model):
    """The plain causal LM with the adapter merged into its weights (for a warm start)."""
    return model.merge_and_unload() if is_lora(model) else model


def hf_state_dict(model) -> dict:
    """``{name: tensor}`` of a (possibly peft) model under the plain checkpoint's names, the
    adapter left out: merge it first (`merge_adapter`) to save or push the merged weights."""
    state = {}
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        state[name] = param.data
    return state


@contextmanager
def merged(model):
    """Merge a peft model's adapter for the duration of the block (no-op for a plain model)."""
    if not is_lora(model):
        yield model
        return
    model.merge_adapter()
    try:
        yield model
    finally:
        model.unmerge_adapter()


class AdapterDisabled:
    """The reference scorer of a LoRA run: `scorer` (the policy's engine) called with the
    adapter of `peft_model` disabled, i.e. the base model's log-probs."""

    def __init__(self, scorer, peft_model) -> None:
        self.scorer, self.peft_model = scorer, peft_model

    def __call__(self, *args, **kwargs):
        with self.peft_model.disable_adapter():
            return self.scorer(*args, **kwargs)
