"""The `openai` rollout engine: a client of an external OpenAI-compatible server (`vllm serve`),
e.g. on other machines, fed the policy as LoRA adapters."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from typing import Optional, Sequence

from ..distributed import zero3_gathered
from .base import Completion, SamplingParams


class OpenAIServerEngine:
    """Rollouts from an external OpenAI-compatible server (`vllm serve MODEL`), e.g. on other machines.

    Uses the completions endpoint with vLLM's extra sampling fields (top_k, min_p) and
    `return_tokens_as_token_ids`, so token ids and per-token log-probs come back exactly.
    Weight sync goes through vLLM's runtime LoRA loading (`/v1/load_lora_adapter`, server
    started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora): the adapter is
    saved to `shared_dir`, which the server must be able to read. Full-weight sync to a
    remote server is not offered: train with LoRA, or use the colocated engine.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        tokenizer,
        *,
        shared_dir: Optional[str] = None,
        timeout_s: float = 600.0,
        adapter_name: str = "policy",
    ):
        self.base_url = base_url.rstrip("/")
        self.adapter_name = adapter_name  # one per training process when several share a server
        self.served_model = model
        self.tokenizer = tokenizer
        self.shared_dir = shared_dir
        self.timeout_s = timeout_s
        self.version = 0
        self.last_sync_s = 0.0

    def _post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            self.base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            text = response.read().decode()
        return json.loads(text) if text.strip().startswith("{") else {}

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[list[Completion]]:
        results = []
        keep = -params.max_prompt_tokens if params.max_prompt_tokens else 0  # left truncation
        for index, prompt in enumerate(prompts):
            prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"][keep:]
            body = {
                "model": self.served_model,
                "prompt": prompt_ids,  # token ids: what was truncated is what the server sees
                "n": params.n,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k or -1,
                "min_p": params.min_p,
                "max_tokens": params.max_new_tokens,
                "stop": list(params.stop) or None,
                "include_stop_str_in_output": True,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
                "seed": params.seed,
            }
            reply = self._post("/v1/completions", body)
            samples = []
            for choice in sorted(reply["choices"], key=lambda c: c["index"]):
                tokens = choice["logprobs"]["tokens"]
                ids = [int(t.split(":", 1)[1]) for t in tokens]
                samples.append(
                    Completion(
                        prompt_index=index,
                        prompt_ids=prompt_ids,
                        completion_ids=ids,
                        text=choice["text"],
                        logprobs=list(choice["logprobs"]["token_logprobs"]),
                        finish_reason="length" if choice["finish_reason"] == "length" else "stop",
                    )
                )
            results.append(samples)
        return results

    def sync_weights(self, model) -> None:
        if not hasattr(model, "peft_config"):
            raise ValueError(
                "OpenAIServerEngine syncs LoRA adapters only; set lora_rank > 0 or use engine=vllm"
            )
        if not self.shared_dir:
            raise ValueError(
                "OpenAIServerEngine needs shared_dir, a directory the server can read, to sync adapters"
            )
        start = time.perf_counter()
        self.version += 1
        name = f"{self.adapter_name}-{self.version}"
        path = os.path.join(self.shared_dir, name)
        with zero3_gathered([p for n, p in model.named_parameters() if "lora_" in n]):
            model.save_pretrained(path)
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if self.version > 1:
            self._post("/v1/unload_lora_adapter", {"lora_name": f"{self.adapter_name}-{self.version - 1}"})
        self.served_model = name
        self.last_sync_s = time.perf_counter() - start
