"""Rollout engines behind one interface (`base.RolloutEngine`); `make_engine` picks one by name
from `ENGINES`, so adding an engine is one row there."""

from __future__ import annotations

import importlib

from .base import Completion, RolloutEngine, SamplingParams

# name -> (module of this package, class). Each class is constructed as ``cls(model, tokenizer,
# **options)``; a module is imported only when its engine is asked for (vLLM is an optional extra).
ENGINES = {
    "hf": ("hf", "HFEngine"),
    "vllm": ("vllm", "VLLMEngine"),
    "openai": ("openai", "OpenAIServerEngine"),
}


def make_engine(name: str, model, tokenizer, **options) -> RolloutEngine:
    """The engine `name`.

    "hf": transformers generate on `model`, the live training module (options: device, synced_gpus,
    max_rows, dtype).
    "vllm": a colocated `vllm.LLM` loading `model`, a hub name or HF-format directory (options:
    gpu_memory_utilization, enable_sleep_mode, sync_bucket_mb, max_model_len,
    max_num_batched_tokens, dtype, seed, temperature).
    "openai": an external OpenAI-compatible server at the URL `model` (options: served_model, the
    served model's name; base_model, the weights the adapter is trained on, checked against the
    server's; shared_dir, where synced adapters are saved for the server to load).
    """
    if name not in ENGINES:
        raise ValueError(f"rollout engine must be one of {list(ENGINES)}, got {name!r}")
    module, cls = ENGINES[name]
    engine_class = getattr(importlib.import_module(f".{module}", __name__), cls)
    return engine_class(model, tokenizer, **options)


__all__ = ["Completion", "RolloutEngine", "SamplingParams", "make_engine", "ENGINES"]
