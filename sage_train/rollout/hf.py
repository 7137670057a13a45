"""The embedded rollout engine: transformers ``generate`` on the training model itself.

It samples from the very weights being trained (no copy), so `sync_weights` only swaps
the model reference. Prompts are left-padded; each prompt is repeated ``params.n`` times.
A completion ends at EOS (kept), at a stop string (kept, the rest cut), or at
``max_new_tokens`` ("length"). Its ``logprobs`` are those of the distribution actually
sampled from (after temperature, top-k, top-p and min-p). With ``params.seed`` the draw
is reproducible and the global RNG is left untouched. Under ZeRO-3 with several ranks,
``synced_gpus`` keeps every rank stepping until all are done, since each forward
gathers parameters collectively.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .base import Completion, SamplingParams


class HFEngine:
    def __init__(
        self, model, tokenizer, *, device: torch.device | str = "cpu", synced_gpus: bool = False
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.device = torch.device(device)
        self.synced_gpus = synced_gpus

    def sync_weights(self, model) -> None:
        self.model = model

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[list[Completion]]:
        encoded = self.tokenizer(list(prompts), padding=True, return_tensors="pt", add_special_tokens=False)
        if params.max_prompt_tokens:  # left padding: the last columns hold each prompt's last tokens
            encoded = {key: value[:, -params.max_prompt_tokens :] for key, value in encoded.items()}
        input_ids = encoded["input_ids"].repeat_interleave(params.n, 0).to(self.device)
        attention_mask = encoded["attention_mask"].repeat_interleave(params.n, 0).to(self.device)
        devices = [self.device] if self.device.type == "cuda" else []
        was_training = self.model.training
        self.model.eval()
        with torch.random.fork_rng(devices=devices, enabled=params.seed is not None), torch.no_grad():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                min_p=params.min_p or None,
                max_new_tokens=params.max_new_tokens,
                stop_strings=list(params.stop) or None,
                tokenizer=self.tokenizer if params.stop else None,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
                output_scores=True,
                return_dict_in_generate=True,
                synced_gpus=self.synced_gpus,
            )
        self.model.train(was_training)
        new_tokens = out.sequences[:, input_ids.shape[1] :]
        if new_tokens.shape[1] > 0:
            scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)
            token_logprobs = scores.gather(-1, new_tokens[..., None]).squeeze(-1).cpu()
        else:
            token_logprobs = torch.zeros(new_tokens.shape)
        new_tokens = new_tokens.cpu()
        prompt_ids = [
            ids[mask.bool()].tolist() for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])
        ]
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
                    logprobs=token_logprobs[row, : len(ids)].tolist(),
                    finish_reason=finish,
                )
            )
        return results

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
