"""Rollout engines behind one interface (`base.RolloutEngine`); `make_engine` picks one by name."""

from __future__ import annotations

from .base import Completion, RolloutEngine, SamplingParams

ENGINES = ("hf",)


def make_engine(name: str, model, tokenizer, **options) -> RolloutEngine:
    """The engine `name` sampling from `model`. "hf": transformers generate (options: device, synced_gpus)."""
    if name == "hf":
        from .hf import HFEngine

        return HFEngine(model, tokenizer, **options)
    raise ValueError(f"rollout engine must be one of {list(ENGINES)}, got {name!r}")


__all__ = ["Completion", "RolloutEngine", "SamplingParams", "make_engine", "ENGINES"]
