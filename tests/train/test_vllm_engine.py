"""The vllm rollout engines.

Everywhere: the colocated engine's bookkeeping against a stand-in for `vllm` (sleep / wake
order, weight pushes in buckets under the checkpoint's names, prefix-cache reset, log-prob
extraction), and the OpenAI-server client against a local HTTP server speaking the
completions and LoRA-loading endpoints. Only where vLLM and CUDA exist: the real engine
generates, a weight sync changes its outputs to the pushed model's, and sleep / wake keep
generation correct.
"""

import json
import threading
import types
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

from sage_train.model import build_char_tokenizer, build_tiny_model
from sage_train.rollout import SamplingParams, make_engine
from sage_train.rollout import vllm as vllm_engines


def tiny(hidden=64, heads=4, kv=2, seed=0):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(
        tokenizer,
        hidden_size=hidden,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv,
        intermediate_size=2 * hidden,
        max_positions=256,
        seed=seed,
    )
    return model, tokenizer


# ----------------------------------------------------------------------------- a stand-in for vllm


class FakeLLM:
    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.loaded = kwargs, [], []
        model = types.SimpleNamespace(
            load_weights=lambda weights: self.loaded.append([n for n, _ in weights])
        )
        runner = types.SimpleNamespace(model=model)
        self.llm_engine = types.SimpleNamespace(
            model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=runner))
        )

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, requests, sampling_params, use_tqdm):
        self.calls.append(("generate", len(requests)))
        outputs = []
        for request in requests:
            samples = [
                types.SimpleNamespace(
                    token_ids=[5, 6],
                    text="ab",
                    logprobs=[
                        {5: types.SimpleNamespace(logprob=-0.5)},
                        {6: types.SimpleNamespace(logprob=-1.5)},
                    ],
                    finish_reason="length",
                )
                for _ in range(sampling_params.n)
            ]
            outputs.append(
                types.SimpleNamespace(prompt_token_ids=request["prompt_token_ids"], outputs=samples)
            )
        return outputs


def fake_vllm():
    return types.SimpleNamespace(LLM=FakeLLM, SamplingParams=lambda **kw: types.SimpleNamespace(**kw))


def test_colocated_engine_bookkeeping(monkeypatch):
    monkeypatch.setattr(vllm_engines, "_import_vllm", fake_vllm)
    model, tokenizer = tiny()
    engine = make_engine("vllm", "/some/model", tokenizer, gpu_memory_utilization=0.25, sync_bucket_mb=1)
    llm = engine.llm
    assert llm.kwargs["enable_sleep_mode"] and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert llm.calls == [("sleep", 1)]

    params = SamplingParams(n=3, max_new_tokens=2, top_k=0, seed=1)
    out = engine.generate(["1+1=", "2+2="], params)
    assert [len(group) for group in out] == [3, 3]
    first = out[1][0]
    assert first.prompt_index == 1 and first.prompt_ids == tokenizer("2+2=")["input_ids"]
    assert (
        first.completion_ids == [5, 6] and first.logprobs == [-0.5, -1.5] and first.finish_reason == "length"
    )
    # before any sync the checkpoint's weights are kept (level 1), after a sync dropped (level 2)
    assert llm.calls[1:] == [
        ("wake_up", ("weights",)),
        ("wake_up", ("kv_cache",)),
        ("generate", 2),
        ("sleep", 1),
    ]

    llm.calls.clear()
    engine.sync_weights(model)
    names = [name for bucket in llm.loaded for name in bucket]
    assert names == [name for name, _ in model.named_parameters()] and len(llm.loaded) >= 1
    assert llm.calls == [("wake_up", ("weights",)), ("reset_prefix_cache",)] and engine.last_sync_s >= 0

    llm.calls.clear()
    engine.generate(["1+1="], params)
    assert llm.calls == [("wake_up", ("kv_cache",)), ("generate", 1), ("sleep", 2)]
    llm.calls.clear(), llm.loaded.clear()
    engine.generate(["1+1="], params)  # dropped weights: the last synced policy is pushed again
    assert llm.loaded and llm.calls[0] == ("wake_up", ("weights",)) and llm.calls[-1] == ("sleep", 2)


def test_sampling_params_translation():
    params = SamplingParams(
        n=2, temperature=0.7, top_p=0.9, top_k=0, min_p=0.01, max_new_tokens=9, stop=("\n",)
    )
    out = vllm_engines.to_vllm_sampling(fake_vllm(), params)
    assert (out.n, out.temperature, out.top_p, out.top_k, out.min_p, out.max_tokens) == (
        2,
        0.7,
        0.9,
        -1,
        0.01,
        9,
    )
    assert out.stop == ["\n"] and out.include_stop_str_in_output and out.logprobs == 0


# ----------------------------------------------------------------------------- an OpenAI-compatible server


class Handler(BaseHTTPRequestHandler):
    requests = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.requests.append((self.path, body))
        if self.path == "/v1/completions":
            choices = [
                {
                    "index": i,
                    "text": "ab",
                    "finish_reason": "stop" if i else "length",
                    "logprobs": {"tokens": ["token_id:5", "token_id:6"], "token_logprobs": [-0.25, -0.75]},
                }
                for i in reversed(range(body["n"]))
            ]
            reply = json.dumps({"choices": choices}).encode()
        else:
            reply = b"Success"
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Handler.requests = []
    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_openai_server_engine(server, tmp_path):
    from sage_train.lora import apply_lora

    model, tokenizer = tiny()
    engine = make_engine("openai", server, tokenizer, served_model="base", shared_dir=str(tmp_path))
    out = engine.generate(["1+1="], SamplingParams(n=2, max_new_tokens=2, min_p=0.01, seed=3))
    path, body = Handler.requests[0]
    assert path == "/v1/completions" and body["model"] == "base" and body["return_tokens_as_token_ids"]
    assert (body["n"], body["min_p"], body["seed"], body["max_tokens"]) == (2, 0.01, 3, 2)
    assert [c.finish_reason for c in out[0]] == ["length", "stop"]  # in choice-index order
    assert out[0][0].completion_ids == [5, 6] and out[0][0].logprobs == [-0.25, -0.75]

    with pytest.raises(ValueError, match="LoRA"):
        engine.sync_weights(model)
    peft_model = apply_lora(model, rank=2, alpha=4.0, dropout=0.0, target_modules=["q_proj"])
    engine.sync_weights(peft_model)
    engine.sync_weights(peft_model)
    paths = [p for p, _ in Handler.requests[1:]]
    assert paths == ["/v1/load_lora_adapter", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"]
    assert (tmp_path / "policy-2" / "adapter_config.json").is_file() and engine.served_model == "policy-2"
    engine.generate(["1+1="], SamplingParams(n=1))
    assert Handler.requests[-1][1]["model"] == "policy-2"


# ----------------------------------------------------------------------------- the real engine (GPU)


def _has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _has_vllm(), reason="needs vLLM and a CUDA GPU")
def test_real_engine_generation_sync_and_sleep(tmp_path, distributed):
    from sage_train.trainer import PolicyHead, make_batch, score

    model, tokenizer = tiny(hidden=256, heads=4, kv=2, seed=0)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    engine = make_engine(
        "vllm", str(tmp_path / "model"), tokenizer, gpu_memory_utilization=0.2, max_model_len=256, seed=0
    )
    greedy = SamplingParams(n=1, temperature=1e-4, max_new_tokens=12)
    prompts = ["1+1=", "What is 7*8?", "abc"]
    before = engine.generate(prompts, greedy)
    assert [len(g) for g in before] == [1, 1, 1] and all(g[0].completion_ids for g in before)

    # a different model pushed in: outputs and log-probs follow it
    other, _ = tiny(hidden=256, heads=4, kv=2, seed=1)
    other = other.cuda().to(torch.bfloat16)
    engine.sync_weights(other)
    after = engine.generate(prompts, greedy)
    assert [g[0].completion_ids for g in after] != [g[0].completion_ids for g in before]
    sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=0))
    completions = [c for g in sampled for c in g]
    batch = make_batch(completions, torch.device("cuda"), tokenizer.pad_token_id)
    train_logp, _ = score(PolicyHead(other), batch, 8, 1.0)
    engine_logp = torch.zeros_like(train_logp)
    for row, c in enumerate(completions):
        engine_logp[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
    mask = batch.completion_mask
    assert (train_logp.float() - engine_logp)[mask].abs().mean() < 0.05

    # after generating, the weights were dropped (sleep level 2); the next generation re-pushes them
    assert engine._weights == "discarded"
    again = engine.generate(prompts, greedy)
    assert [g[0].completion_ids for g in again] == [g[0].completion_ids for g in after]
