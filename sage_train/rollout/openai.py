"""The `openai` rollout engine: a client of an external OpenAI-compatible server (`vllm serve`),
e.g. on other machines, fed the policy as LoRA adapters."""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from ..distributed import zero3_gathered
from .base import Completion, SamplingParams, prompt_seeds


def same_model(served: str, base: str) -> bool:
    """Whether the server's model (the path or hub name it loaded) is `base`."""
    if served == base:
        return True
    return os.path.exists(served) and os.path.exists(base) and os.path.samefile(served, base)


class OpenAIServerEngine:
    """Rollouts from an external OpenAI-compatible server (`vllm serve MODEL`), e.g. on other machines.

    One call is one request to the completions endpoint: every prompt goes as token ids (the
    trainer's own tokenization, with no special tokens added by the server, so no second BOS),
    with vLLM's extra sampling fields (top_k, min_p) and `return_tokens_as_token_ids`, so token
    ids and per-token log-probs come back exactly. A request carries one seed for all its prompts,
    which would give every prompt the same sampling noise, so a seed is sent only for a call of
    one prompt. The log-probs are those the server reports: start it with ``--logprobs-mode
    raw_logprobs`` at temperature 1 (`sage_train.rl_maths`).

    served_model: the name under which the server serves the base model (the model given to
    ``vllm serve``, or its ``--served-model-name``).
    base_model: the weights the policy's adapter is trained on; when given, the server's model
    (``GET /v1/models``: its ``root``) must be it, or the engine refuses to start: an adapter
    loaded onto other weights samples from another policy without any error.

    Weight sync goes through vLLM's runtime LoRA loading (`/v1/load_lora_adapter`, server
    started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora): the adapter is
    saved to `shared_dir`, which the server must be able to read. Full-weight sync to a
    remote server is not offered: train with LoRA, or use the colocated engine. `pushes`
    counts the adapter loads, `last_sync_s` times the last one.
    """

    def __init__(
        self,
        base_url: str,
        tokenizer,
        *,
        served_model: str,
        base_model: str | None = None,
        shared_dir: str | None = None,
        timeout_s: float = 600.0,
        adapter_name: str = "policy",
    ):
        self.base_url = base_url.rstrip("/")
        self.adapter_name = adapter_name  # one per training process when several share a server
        self.served_model = served_model
        self.tokenizer = tokenizer
        self.shared_dir = shared_dir
        self.timeout_s = timeout_s
        self.version = 0
        self.pushes = 0
        self.last_sync_s = 0.0
        if base_model is not None:
            self.check_base(base_model)

    def _request(self, path: str, body: dict | None = None) -> dict:
        """POST `body` (GET without one) and the JSON reply; a refused request raises naming the server."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            raise RuntimeError(f"the server at {self.base_url} refused {path} (HTTP {error.code}): {detail}") from None
        except urllib.error.URLError as error:
            raise RuntimeError(f"cannot reach the server at {self.base_url} ({path}): {error.reason}") from None
        return json.loads(text) if text.strip().startswith("{") else {}

    def check_base(self, base_model: str) -> None:
        """Refuse a server that does not serve `base_model` under the name `served_model`."""
        cards = {card["id"]: card for card in self._request("/v1/models").get("data", [])}
        if self.served_model not in cards:
            raise ValueError(
                f"the server at {self.base_url} serves {sorted(cards)}, not {self.served_model!r} "
                "(config key 'openai_model', or 'model' when it is empty)"
            )
        root = cards[self.served_model].get("root") or self.served_model
        if not same_model(root, base_model):
            raise ValueError(
                f"the server at {self.base_url} serves {root!r} as {self.served_model!r}, but the policy's "
                f"adapter is trained on {base_model!r}; the adapter would be applied to other weights. "
                f"Serve the trained base: vllm serve {base_model} --enable-lora ..."
            )

    def awake(self):
        return contextlib.nullcontext()

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[list[Completion]]:
        keep = -params.max_prompt_tokens if params.max_prompt_tokens else 0  # left truncation
        # token ids: no special tokens added twice, and what was truncated is what the server sees
        prompt_ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"][keep:] for p in prompts]
        seeds = prompt_seeds(params, len(prompts))
        body = {
            "model": self.served_model,
            "prompt": prompt_ids,
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
            "seed": seeds[0] if len(prompts) == 1 else None,
        }
        reply = self._request("/v1/completions", body)
        choices = sorted(reply.get("choices", []), key=lambda c: c["index"])
        if len(choices) != len(prompts) * params.n:
            raise RuntimeError(
                f"the server at {self.base_url} returned {len(choices)} completions for {len(prompts)} "
                f"prompt(s) x n={params.n}"
            )
        results: list[list[Completion]] = [[] for _ in prompts]
        for position, choice in enumerate(choices):
            index = position // params.n  # choices come prompt by prompt, n each
            tokens = choice["logprobs"]["tokens"]
            results[index].append(
                Completion(
                    prompt_index=index,
                    prompt_ids=prompt_ids[index],
                    completion_ids=[int(t.split(":", 1)[1]) for t in tokens],
                    text=choice["text"],
                    logprobs=[float(lp) for lp in choice["logprobs"]["token_logprobs"]],
                    finish_reason="length" if choice["finish_reason"] == "length" else "stop",
                )
            )
        return results

    def sync_weights(self, model) -> None:
        if not hasattr(model, "peft_config"):
            raise ValueError("OpenAIServerEngine syncs LoRA adapters only; set lora_rank > 0 or use engine=vllm")
        if not self.shared_dir:
            raise ValueError("OpenAIServerEngine needs shared_dir, a directory the server can read, to sync adapters")
        start = time.perf_counter()
        self.version += 1
        name = f"{self.adapter_name}-{self.version}"
        path = os.path.join(self.shared_dir, name)
        with zero3_gathered([p for n, p in model.named_parameters() if "lora_" in n]):
            model.save_pretrained(path)
        self._request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if self.version > 1:
            self._request("/v1/unload_lora_adapter", {"lora_name": f"{self.adapter_name}-{self.version - 1}"})
        self.served_model = name
        self.pushes += 1
        self.last_sync_s = time.perf_counter() - start
