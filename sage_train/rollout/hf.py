"""The embedded rollout engine: transformers ``generate`` on the training model itself.

It samples from the very weights being trained, so `sync_weights` only swaps the model reference
and `awake` has nothing to keep. With ``dtype`` (say bfloat16, on CPUs with AVX-512 BF16 or AMX
several times faster than float32 at these shapes) it samples from a copy of the model whose
parameters are in that dtype (buffers such as rotary frequencies stay as they are), refreshed from
the live model at every call: a copy can never be stale, whatever the caller syncs or resumes, and
the refresh (one cast of every parameter) costs far less than one decode step. Its log-probs then
differ from the trainer's as a vLLM engine's do; ``tis_level`` corrects for that.

Prompts are left-padded; each prompt is repeated ``params.n`` times. A completion ends at EOS
(kept), at a stop string (kept, the rest cut), or at ``max_new_tokens`` ("length").

Sampling is done here, not by ``generate``'s sampler, so that every row draws from a generator
of its own (`_RowSampler`): sample j of prompt i is fixed by that prompt's seed and j, whatever
else is in the batch. A seeded call leaves the global RNG untouched; an unseeded one draws its
prompts' seeds from it. Each prompt's KV cache is computed once and shared by its samples
(`HFEngine._shared_prompt_cache`). The distribution is vLLM's: temperature, then min-p, top-k and top-p. The
reported ``logprobs`` are those of the temperature-scaled distribution before truncation (see
`sage_train.rollout.base`). Under ZeRO-3 with several ranks, ``synced_gpus`` keeps every rank
stepping until all are done, since each forward gathers parameters collectively.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from collections.abc import Sequence

import torch
from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .base import Completion, SamplingParams, derive_seed, prompt_seeds

# transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns, then goes away)
_CACHE_KEY = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


class _RowSampler(LogitsProcessor):
    """Turns greedy decoding into sampling with one generator per row: the truncated
    distribution's probabilities divided by Exp(1) noise have their argmax at a draw from those
    probabilities (the exponential race, as vLLM samples)."""

    def __init__(self, params: SamplingParams, generators: list[torch.Generator]):
        self.generators = generators
        self.warpers = [TemperatureLogitsWarper(params.temperature)]
        if params.min_p > 0:
            self.warpers.append(MinPLogitsWarper(params.min_p))
        if params.top_k > 0:
            self.warpers.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(params.top_p))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        probs = scores.float().softmax(-1)
        noise = torch.stack(
            [torch.empty(probs.shape[1], device=probs.device).exponential_(generator=g) for g in self.generators]
        )
        return probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)


class HFEngine:
    """max_rows: at most this many rows (prompts x n) per ``generate`` of the model, 0 for all at
    once; a larger call runs in pieces (the same samples: each row has its own generator).
    dtype: the parameters' dtype to sample with (module docstring); None samples the model as it is."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        device: torch.device | str = "cpu",
        synced_gpus: bool = False,
        max_rows: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        if dtype is not None and synced_gpus:
            raise ValueError("dtype: a sampling copy of the model cannot be made under ZeRO-3 (synced_gpus)")
        self.model, self.tokenizer = model, tokenizer
        self.device = torch.device(device)
        self.synced_gpus = synced_gpus
        self.max_rows = max_rows
        self.dtype = dtype
        self._copy = None  # (the model it copies, the copy) once dtype asks for one

    def sync_weights(self, model) -> None:
        self.model = model

    def awake(self):
        return contextlib.nullcontext()

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[list[Completion]]:
        seeds = [s if s is not None else int(torch.randint(2**31 - 1, ())) for s in prompt_seeds(params, len(prompts))]
        step = max(1, self.max_rows // params.n) if self.max_rows else len(prompts)
        results = []
        for first in range(0, len(prompts), step):
            part = dataclasses.replace(params, seed=None, prompt_seeds=tuple(seeds[first : first + step]))
            for group in self._generate(prompts[first : first + step], part):
                results.append([dataclasses.replace(c, prompt_index=len(results)) for c in group])
        return results

    def _generate(self, prompts: Sequence[str], params: SamplingParams) -> list[list[Completion]]:
        encoded = self.tokenizer(list(prompts), padding=True, return_tensors="pt", add_special_tokens=False)
        if params.max_prompt_tokens:  # left padding: the last columns hold each prompt's last tokens
            encoded = {key: value[:, -params.max_prompt_tokens :] for key, value in encoded.items()}
        input_ids = encoded["input_ids"].repeat_interleave(params.n, 0).to(self.device)
        attention_mask = encoded["attention_mask"].repeat_interleave(params.n, 0).to(self.device)
        generators = [
            torch.Generator(self.device).manual_seed(derive_seed(seed, sample))
            for seed in params.prompt_seeds
            for sample in range(params.n)
        ]
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            model = self._sampling_model()
            cache = self._shared_prompt_cache(model, encoded, params.n)
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                **({} if cache is None else {_CACHE_KEY: cache}),
                do_sample=False,  # the draw is _RowSampler's
                logits_processor=LogitsProcessorList([_RowSampler(params, generators)]),
                max_new_tokens=params.max_new_tokens,
                stop_strings=list(params.stop) or None,
                tokenizer=self.tokenizer if params.stop else None,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
                output_logits=params.logprobs,  # the raw logits, before any processor
                return_dict_in_generate=True,
                synced_gpus=self.synced_gpus,
            )
        self.model.train(was_training)
        new_tokens = out.sequences[:, input_ids.shape[1] :]
        if new_tokens.shape[1] > 0 and params.logprobs:
            # step by step: stacking the [rows, V] logits of every step first would copy them all, twice
            token_logprobs = torch.stack(
                [
                    (logits.float() / params.temperature).log_softmax(-1).gather(-1, new_tokens[:, t, None])[:, 0]
                    for t, logits in enumerate(out.logits)
                ],
                dim=1,
            ).cpu()
        else:
            token_logprobs = torch.zeros(new_tokens.shape)
        new_tokens = new_tokens.cpu()
        prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])]
        results: list[list[Completion]] = [[] for _ in prompts]
        for row in range(new_tokens.shape[0]):
            index = row // params.n
            ids, finish = self._cut(new_tokens[row].tolist(), params)
            results[index].append(
                Completion(
                    prompt_index=index,
                    prompt_ids=prompt_ids[index],
                    completion_ids=ids,
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                    logprobs=token_logprobs[row, : len(ids)].tolist() if params.logprobs else None,
                    finish_reason=finish,
                )
            )
        return results

    def _sampling_model(self):
        """The model `generate` runs: the live one, or its copy in ``dtype`` with every parameter
        refreshed from it now (the two enumerate parameters alike: the copy is a deepcopy)."""
        if self.dtype is None or all(p.dtype == self.dtype for p in self.model.parameters()):
            return self.model
        if self._copy is None or self._copy[0] is not self.model:
            replica = copy.deepcopy(self.model)
            for param in replica.parameters():
                param.requires_grad_(False)
                param.grad = None
                param.data = param.data.to(self.dtype)
            self._copy = (self.model, replica)
        else:
            for mine, live in zip(self._copy[1].parameters(), self.model.parameters()):
                mine.copy_(live)
        self._copy[1].eval()
        return self._copy[1]

    def _shared_prompt_cache(self, model, encoded: dict, n: int):
        """The KV cache of every prompt but its last token, computed once per prompt and repeated
        for its `n` samples (``generate`` then runs the last prompt token and the completion), or
        None (one sample, a one-token prompt, or ZeRO-3 across ranks). ``generate`` itself would
        recompute the same prompt n times: with n = 8 and prompts as long as the completions,
        nearly half the work of a group."""
        ids, mask = encoded["input_ids"].to(self.device), encoded["attention_mask"].to(self.device)
        if n == 1 or ids.shape[1] < 2 or self.synced_gpus or not mask[:, :-1].any(-1).all():
            return None
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers left-padded rows
        model(
            input_ids=ids[:, :-1],
            attention_mask=mask[:, :-1],
            position_ids=positions[:, :-1],
            **{_CACHE_KEY: cache},
            use_cache=True,
            logits_to_keep=1,  # the prompt's logits are not needed
        )
        cache.batch_repeat_interleave(n)
        return cache

    def _cut(self, ids: list[int], params: SamplingParams) -> tuple[list[int], str]:
        """The completion's tokens up to the first stop string (kept) or EOS (kept), and why it ended.

        `generate` pads a row after it stops; when the pad token is EOS (common for base models),
        a row stopped by a stop string is followed by pad = EOS tokens that were never sampled, so
        the stop string is looked for first, up to the first EOS. Stop-string presence only grows
        with the prefix, so the shortest prefix holding one is found by bisection (a few decodes)."""
        eos = self.tokenizer.eos_token_id
        end = ids.index(eos) + 1 if eos in ids else len(ids)

        def stopped(n: int) -> bool:
            text = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            return any(stop in text for stop in params.stop)

        if params.stop and stopped(end):
            low, high = 1, end  # the shortest prefix with a stop string lies in [low, high]
            while low < high:
                middle = (low + high) // 2
                low, high = (low, middle) if stopped(middle) else (middle + 1, high)
            return ids[:high], "stop"
        if eos in ids:
            return ids[:end], "stop"
        return ids, "length"
