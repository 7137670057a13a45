"""The rollout engine interface: prompts in, sampled completions (with their log-probs) out.

Engines: `hf.py` (transformers `generate`, the embedded default), `vllm.py` (a colocated vLLM
engine on GPUs) and `openai.py` (an external OpenAI-compatible server), one row each of
`ENGINES`, beside the interface they implement; `make_engine` picks one by name, so adding an
engine is one row there. Training and evaluation both sample through this interface.

Seeds. A seeded call draws each prompt's samples from that prompt's own seed (`prompt_seeds`),
so prompts never share sampling noise and a prompt's samples do not depend on what else is in
the call (up to the engine's batch numerics).

Log-probs. Every engine reports, for each sampled token, its log-prob under the temperature-
scaled distribution *before* top-k / top-p / min-p truncation: the quantity the trainer computes
(`sage_train.policy.score`), so that truncated importance sampling (`sage_train.rl_maths`)
compares like with like and gives weights of 1 where the engine and the trainer agree.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. top_k 0 and top_p 1.0 and min_p 0.0 mean "off"; `stop` strings end a
    completion (the stop string is kept in the text); `n` samples per prompt; a prompt longer than
    ``max_prompt_tokens`` tokens keeps only its last ones (0: no limit).

    seed: the call's seed; prompt i is drawn with `derive_seed(seed, i)` (None: unseeded).
    prompt_seeds: one seed per prompt of the call, used instead (evaluation gives each problem a
    seed of its own, so that batching problems does not change their samples).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int | None = None
    max_prompt_tokens: int = 0
    prompt_seeds: tuple[int, ...] | None = None
    logprobs: bool = True  # completions carry log-probs (evaluation needs none)

    @classmethod
    def for_rollouts(cls, rollout: RolloutSettings, seed: int) -> SamplingParams:
        """A training run's rollouts: ``group_size`` samples per prompt at the training temperature,
        drawn from `seed`."""
        return cls(
            n=rollout.group_size,
            temperature=rollout.temperature,
            max_new_tokens=rollout.max_new_tokens,
            seed=seed,
            **_run_options(rollout),
        )

    @classmethod
    def for_evaluation(cls, rollout: RolloutSettings) -> SamplingParams:
        """A training run's own evaluation: its eval temperature and length; the evaluator sets n and
        the seeds."""
        return cls(
            temperature=rollout.eval_temperature,
            max_new_tokens=rollout.eval_max_new_tokens or rollout.max_new_tokens,
            **_run_options(rollout),
        )

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p cut the distribution sampled from."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _run_options(rollout: RolloutSettings) -> dict:
    """The sampling keys a run sets for its rollouts and its evaluation alike."""
    return {
        "top_p": rollout.top_p,
        "top_k": rollout.top_k,
        "min_p": rollout.min_p,
        "stop": tuple(rollout.stop),
        "max_prompt_tokens": rollout.max_prompt_length,
    }


def derive_seed(seed: int, *parts) -> int:
    """A 31-bit seed fixed by `seed` and `parts` (independent streams for different parts)."""
    digest = hashlib.blake2b(":".join(map(str, (seed, *parts))).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def prompt_seeds(params: SamplingParams, count: int) -> list[int | None]:
    """The seed of each of the call's `count` prompts (see `SamplingParams`)."""
    if params.prompt_seeds is not None:
        if len(params.prompt_seeds) != count:
            raise ValueError(f"prompt_seeds has {len(params.prompt_seeds)} seeds for {count} prompts")
        return list(params.prompt_seeds)
    if params.seed is None:
        return [None] * count
    return [derive_seed(params.seed, index) for index in range(count)]


@dataclass
class Completion:
    """One sampled completion of one prompt.

    prompt_ids / completion_ids: token ids (the completion ends with EOS when the model
    stopped by itself). logprobs: the sampling engine's log-prob of each completion token under
    the temperature-scaled distribution before top-k / top-p / min-p truncation (module
    docstring; None if the engine has none). finish_reason: "stop" (EOS or a stop string) or
    "length".
    """

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    finish_reason: str = "stop"
    meta: dict = field(default_factory=dict)


class RolloutEngine(Protocol):
    """generate(prompts, params) -> for each prompt, params.n completions (a list per prompt).
    sync_weights(model): make the engine sample from `model`'s current weights.
    awake(): a context in which the engine stays ready between generate calls (an engine that
    frees its memory after each call, as the colocated vLLM one does, frees it on leaving)."""

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[list[Completion]]: ...

    def sync_weights(self, model) -> None: ...

    def awake(self) -> AbstractContextManager: ...


# name -> (module of this package, class). Each class is constructed as ``cls(model, tokenizer,
# **options)``; a module is imported only when its engine is asked for (vLLM is an optional extra).
ENGINES = {
    "hf": ("hf", "HFEngine"),
    "vllm": ("vllm", "VLLMEngine"),
    "openai": ("openai", "OpenAIServerEngine"),
}
#: ``hf_rollout_dtype``'s values: the hf engine samples from a copy in that dtype ("": the model's own)
HF_ROLLOUT_DTYPES = ("", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class RolloutSettings:
    """A run's sampling keys and its engine's (``rollout_engine``, one of `ENGINES`), for its rollouts
    (`SamplingParams.for_rollouts`) and its own evaluation (`SamplingParams.for_evaluation`)."""

    rollout_engine: str
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_new_tokens: int
    stop: list
    max_prompt_length: int
    group_size: int
    eval_temperature: float
    eval_max_new_tokens: int
    hf_rollout_dtype: str
    vllm_gpu_memory_utilization: float
    vllm_sleep_mode: bool
    vllm_sync_bucket_mb: int
    vllm_max_model_len: int
    vllm_max_num_batched_tokens: int
    vllm_dtype: str
    openai_base_url: str
    openai_model: str
    openai_shared_dir: str


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
    engine_class = getattr(importlib.import_module(f".{module}", __package__), cls)
    return engine_class(model, tokenizer, **options)
