"""Rollout engines behind one interface (`base.RolloutEngine`); `make_engine` picks one by name."""

from __future__ import annotations

from .base import Completion, RolloutEngine, SamplingParams

ENGINES = ("hf", "vllm", "openai")


def make_engine(name: str, model, tokenizer, **options) -> RolloutEngine:
    """The engine `name`.

    "hf": transformers generate on `model`, the live training module (options: device, synced_gpus,
    max_rows).
    "vllm": a colocated `vllm.LLM` loading `model`, a hub name or HF-format directory (options:
    gpu_memory_utilization, enable_sleep_mode, sync_bucket_mb, max_model_len,
    max_num_batched_tokens, dtype, seed, logprobs_mode).
    "openai": an external OpenAI-compatible server at the URL `model` (options: served_model, the
    served model's name; base_model, the weights the adapter is trained on, checked against the
    server's; shared_dir, where synced adapters are saved for the server to load).
    vllm and openai are imported only when asked for: vLLM is an optional extra.
    """
    if name == "hf":
        from .hf import HFEngine

        return HFEngine(model, tokenizer, **options)
    if name == "vllm":
        from .vllm import VLLMEngine

        return VLLMEngine(model, tokenizer, **options)
    if name == "openai":
        from .openai import OpenAIServerEngine

        served = options.pop("served_model")
        return OpenAIServerEngine(model, served, tokenizer, **options)
    raise ValueError(f"rollout engine must be one of {list(ENGINES)}, got {name!r}")


__all__ = ["Completion", "RolloutEngine", "SamplingParams", "make_engine", "ENGINES"]
