"""The openai rollout engine against a real HTTP server of our own on 127.0.0.1.

`CompletionsServer` speaks the part of vLLM's OpenAI-compatible protocol the engine uses
(``/v1/models``, ``/v1/completions`` with token-id prompts and ``return_tokens_as_token_ids``,
runtime LoRA loading), backed by the hf engine, and records every request. It runs in a thread
and shuts itself down after `LIFETIME_S` whatever happens to the test."""

import copy
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch
from tiny_models import tiny_model

from sage_train.config import ConfigError
from sage_train.models.loading import build_char_tokenizer, load_pretrained
from sage_train.models.lora import apply_lora
from sage_train.policy import PolicyHead, make_batch, score
from sage_train.rollout import SamplingParams
from sage_train.rollout.hf import HFEngine
from sage_train.rollout.openai import OpenAIServerEngine

LIFETIME_S = 300


class CompletionsServer:
    """An OpenAI-compatible completions server serving the HF model at `root` as `name`."""

    def __init__(self, root: str, name: str = "base"):
        import peft

        self.root, self.peft = root, peft
        self.base, self.tokenizer = load_pretrained(root)
        self.models = {name: (root, None, HFEngine(self.base, self.tokenizer))}  # name -> (root, parent, engine)
        self.requests: list[tuple[str, dict]] = []
        self.httpd = HTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.timer = threading.Timer(LIFETIME_S, self.httpd.shutdown)
        self.timer.daemon = True
        self.timer.start()

    def close(self) -> None:
        self.timer.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()

    def calls(self, path: str) -> list[dict]:
        return [body for p, body in self.requests if p == path]

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def reply(self, code: int, payload) -> None:
                data = (json.dumps(payload) if not isinstance(payload, str) else payload).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                server.requests.append((self.path, {}))
                if self.path != "/v1/models":
                    return self.reply(404, {"error": {"message": f"no route {self.path}"}})
                cards = [{"id": n, "object": "model", "root": r, "parent": p} for n, (r, p, _) in server.models.items()]
                self.reply(200, {"object": "list", "data": cards})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append((self.path, body))
                routes = {
                    "/v1/completions": server.complete,
                    "/v1/load_lora_adapter": server.load_adapter,
                    "/v1/unload_lora_adapter": server.unload_adapter,
                }
                if self.path not in routes:
                    return self.reply(404, {"error": {"message": f"no route {self.path}"}})
                try:
                    self.reply(200, routes[self.path](body))
                except KeyError as error:
                    self.reply(404, {"error": {"message": f"unknown model {error}"}})

        return Handler

    def complete(self, body: dict) -> dict:
        _, _, engine = self.models[body["model"]]
        prompts = body["prompt"]
        assert isinstance(prompts, list) and all(isinstance(p, list) for p in prompts), "token-id prompts only"
        params = SamplingParams(
            n=body["n"],
            temperature=body["temperature"],
            top_p=body["top_p"],
            top_k=max(0, body["top_k"]),
            min_p=body["min_p"],
            max_new_tokens=body["max_tokens"],
            stop=tuple(body["stop"] or ()),
            seed=body.get("seed"),
        )
        texts = [self.tokenizer.decode(ids) for ids in prompts]  # the char tokenizer round-trips exactly
        choices = []
        for group in engine.generate(texts, params):
            for c in group:
                tokens = [f"token_id:{t}" for t in c.completion_ids]
                choices.append(
                    {
                        "index": len(choices),
                        "text": c.text,
                        "logprobs": {"tokens": tokens, "token_logprobs": c.logprobs},
                        "finish_reason": c.finish_reason,
                    }
                )
        return {"object": "text_completion", "model": body["model"], "choices": choices}

    def load_adapter(self, body: dict) -> str:
        adapted = self.peft.PeftModel.from_pretrained(copy.deepcopy(self.base), body["lora_path"]).merge_and_unload()
        self.models[body["lora_name"]] = (body["lora_path"], self.root, HFEngine(adapted, self.tokenizer))
        return f"Success: LoRA adapter '{body['lora_name']}' added successfully."

    def unload_adapter(self, body: dict) -> str:
        del self.models[body["lora_name"]]
        return f"Success: LoRA adapter '{body['lora_name']}' removed successfully."


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny(path, seed):
    tokenizer = build_char_tokenizer()
    tiny_model(tokenizer, seed=seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = save_tiny(tmp_path_factory.mktemp("base"), seed=0)
    server = CompletionsServer(root)
    yield server
    server.close()


@pytest.fixture
def server(served):
    """The module's server, its record of requests cleared and its adapters unloaded."""
    served.requests.clear()
    for name in [n for n, (_, parent, _) in served.models.items() if parent is not None]:
        del served.models[name]
    return served


def scored(model, completions, tokenizer, temperature=1.0):
    batch = make_batch(completions, torch.device("cpu"), tokenizer.pad_token_id)
    logp, _ = score(PolicyHead(model), batch, 8, temperature)
    engine = torch.zeros_like(logp)
    for row, c in enumerate(completions):
        engine[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
    mask = batch.completion_mask
    return logp[mask], engine[mask]


def test_all_prompts_go_as_token_ids_in_one_request(server):
    tokenizer = server.tokenizer
    engine = OpenAIServerEngine(server.url, tokenizer, served_model="base", base_model=server.root)
    prompts = ["12+34=", "7+8=", "Compute 5*6."]
    groups = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, min_p=0.05, seed=3))
    (request,) = server.calls("/v1/completions")
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert request["prompt"] == ids  # the trainer's tokens exactly: the server adds no special token
    assert request["seed"] is None  # one seed for several prompts would give them the same noise
    assert request["return_tokens_as_token_ids"] is True and request["logprobs"] == 0
    assert [len(g) for g in groups] == [2, 2, 2]
    for index, group in enumerate(groups):
        for c in group:
            assert c.prompt_index == index and c.prompt_ids == ids[index]
            assert c.text == tokenizer.decode(c.completion_ids, skip_special_tokens=True)
    train, reported = scored(server.base, [c for g in groups for c in g], tokenizer)
    torch.testing.assert_close(train, reported, atol=1e-5, rtol=0)  # importance weights of 1

    engine.generate(["1+1="], SamplingParams(n=1, max_new_tokens=3, seed=3))
    assert server.calls("/v1/completions")[-1]["seed"] is not None  # one prompt: seeded


def test_a_mismatched_base_is_refused(server, tmp_path):
    other = save_tiny(tmp_path / "other", seed=1)
    with pytest.raises(ValueError, match=r"serves '.*base.*' as 'base', but the policy's adapter is trained on"):
        OpenAIServerEngine(server.url, server.tokenizer, served_model="base", base_model=other)
    with pytest.raises(ValueError, match=r"serves \['base'\], not 'other' \(config key 'openai_model'"):
        OpenAIServerEngine(server.url, server.tokenizer, served_model="other", base_model=other)
    OpenAIServerEngine(
        server.url, server.tokenizer, served_model="base", base_model=server.root
    )  # the right one passes
    with pytest.raises(RuntimeError, match=r"refused /v1/completions \(HTTP 404\)"):
        OpenAIServerEngine(server.url, server.tokenizer, served_model="gone").generate(["1="], SamplingParams())
    with pytest.raises(RuntimeError, match="cannot reach the server at http://127.0.0.1"):
        OpenAIServerEngine(
            f"http://127.0.0.1:{closed_port()}", server.tokenizer, served_model="base", base_model=server.root
        )


def test_sync_loads_the_adapter_and_samples_from_it(server, tmp_path):
    tokenizer = server.tokenizer
    policy = apply_lora(
        load_pretrained(server.root)[0], rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"]
    )
    generator = torch.Generator().manual_seed(0)  # an adapter far from zero, the same on every run
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    engine = OpenAIServerEngine(
        server.url, tokenizer, served_model="base", base_model=server.root, shared_dir=str(tmp_path)
    )
    engine.sync_weights(policy)
    engine.sync_weights(policy)
    assert engine.pushes == 2 and engine.served_model == "policy-2"
    assert [b["lora_name"] for b in server.calls("/v1/load_lora_adapter")] == ["policy-1", "policy-2"]
    assert [b["lora_name"] for b in server.calls("/v1/unload_lora_adapter")] == ["policy-1"]
    groups = engine.generate(["12+34=", "9+9="], SamplingParams(n=2, max_new_tokens=6))
    assert server.calls("/v1/completions")[0]["model"] == "policy-2"
    train, reported = scored(policy, [c for g in groups for c in g], tokenizer)
    torch.testing.assert_close(train, reported, atol=1e-4, rtol=0)
    base, _ = scored(server.base, [c for g in groups for c in g], tokenizer)
    assert (base - reported).abs().max() > 1e-2  # the adapter changed what the server samples from


def test_a_run_makes_one_request_per_generation_and_one_push_per_step(server, tiny_config, distributed):
    from sage_train import report
    from sage_train.run import train

    cfg = tiny_config(
        name="openai",
        model=server.root,
        rollout_engine="openai",
        openai_base_url=server.url,
        openai_model="base",
        lora_rank=4,
        lora_target_modules=["q_proj", "v_proj"],
        steps=2,
        eval_problems=4,
        eval_samples=2,
        eval_splits=["test"],
        tis_level="token",
        min_p=0.05,
    )
    summary = train(cfg)
    # eval before, two steps, eval after: one request each (all of this rank's prompts at once)
    assert [len(b["prompt"]) for b in server.calls("/v1/completions")] == [4, 4, 4, 4]
    assert len(server.calls("/v1/load_lora_adapter")) == 3  # before the run, then after each step
    rows = report.read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["rollout/sync_time"] > 0 for r in rows)
    assert all(abs(r["tis/weight_mean"] - 1) < 1e-3 for r in rows)  # the served adapter is the policy
    assert summary["eval_after"]["test"]["problems"] == 4


def test_config_refuses_a_base_the_server_cannot_serve(tiny_config):
    common = dict(rollout_engine="openai", openai_base_url="http://127.0.0.1:1", lora_rank=4)
    with pytest.raises(ConfigError, match="config key 'rollout_engine'.*not the weights the adapter"):
        tiny_config(**common)  # model "tiny" is built in the trainer
    with pytest.raises(ConfigError, match="config key 'rollout_engine'.*sft_steps > 0"):
        tiny_config(**common, model="Qwen/Qwen2.5-Math-7B", sft_steps=10)
    with pytest.raises(ConfigError, match="config key 'vllm_max_num_batched_tokens' must be an integer >= 0"):
        tiny_config(vllm_max_num_batched_tokens=-1)
