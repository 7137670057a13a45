"""The rollout engine interface: prompts in, sampled completions (with their log-probs) out.

Engines: `hf.py` (transformers `generate`, the embedded default) and, on GPUs, `vllm.py`.
Training and evaluation both sample through this interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. top_k 0 and top_p 1.0 and min_p 0.0 mean "off"; `stop` strings end a
    completion (the stop string is kept in the text); `n` samples per prompt; a prompt longer than
    ``max_prompt_tokens`` tokens keeps only its last ones (0: no limit)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: Optional[int] = None
    max_prompt_tokens: int = 0


@dataclass
class Completion:
    """One sampled completion of one prompt.

    prompt_ids / completion_ids: token ids (the completion ends with EOS when the model
    stopped by itself). logprobs: the sampling engine's log-prob of each completion token
    under the temperature-scaled distribution it sampled from (None if the engine has none).
    finish_reason: "stop" (EOS or a stop string) or "length".
    """

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    logprobs: Optional[list[float]] = None
    finish_reason: str = "stop"
    meta: dict = field(default_factory=dict)


class RolloutEngine(Protocol):
    """generate(prompts, params) -> for each prompt, params.n completions (a list per prompt).
    sync_weights(model): make the engine sample from `model`'s current weights."""

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[list[Completion]]: ...

    def sync_weights(self, model) -> None: ...
