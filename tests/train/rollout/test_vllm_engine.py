"""The vllm rollout engines, where vLLM and a CUDA GPU exist (the `vllm` extra): the real engine
generates, a weight sync changes its outputs to the pushed model's, and sleep / wake keep
generation correct. Elsewhere this module skips: no stand-in replaces vLLM."""

import os

import pytest
import torch
from tiny_models import tiny_model

from sage_train.models.loading import build_char_tokenizer
from sage_train.rollout import SamplingParams, make_engine


def tiny(hidden=64, heads=4, kv=2, seed=0):
    tokenizer = build_char_tokenizer()
    return tiny_model(tokenizer, seed=seed, max_positions=256, hidden=hidden, heads=heads, kv_heads=kv), tokenizer


# ----------------------------------------------------------------------------- the real engine (GPU)


def _has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _has_vllm(), reason="needs vLLM and a CUDA GPU")
def test_real_engine_sync_sessions_seeds_and_logprobs(tmp_path, distributed):
    from sage_train.policy import PolicyHead, make_batch, score
    from sage_train.rollout.base import derive_seed

    model, tokenizer = tiny(hidden=256, heads=4, kv=2, seed=0)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    engine = make_engine(
        "vllm", str(tmp_path / "model"), tokenizer, gpu_memory_utilization=0.2, max_model_len=256, seed=0
    )
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=0)
    prompts = ["1+1=", "What is 7*8?", "abc"]

    def ids(groups):
        return [[c.completion_ids for c in g] for g in groups]

    # level-2 sleep from start-up: no weights until the first push
    with pytest.raises(RuntimeError, match="call sync_weights"):
        engine.generate(prompts, params)
    policy = model.cuda().to(torch.bfloat16)
    engine.sync_weights(policy)
    assert engine.pushes == 1 and engine.last_sync_s > 0
    first = engine.generate(prompts, params)
    assert [len(g) for g in first] == [2, 2, 2] and all(c.completion_ids for g in first for c in g)
    again = engine.generate(prompts, params)  # after a level-2 sleep: re-pushed, the same seeded draw
    assert ids(again) == ids(first) and engine.pushes == 2
    # each prompt has its own seed: one prompt twice in a call is sampled twice, not copied
    twice = engine.generate(["abc", "abc"], params)
    assert ids(twice)[0] != ids(twice)[1]
    explicit = SamplingParams(n=2, max_new_tokens=12, prompt_seeds=tuple(derive_seed(0, i) for i in range(3)))
    assert ids(engine.generate(prompts, explicit)) == ids(first)

    # an evaluation: several generate calls inside one awake session push nothing more
    engine.sync_weights(policy)
    pushes = engine.pushes
    with engine.awake():
        for _ in range(3):
            assert ids(engine.generate(prompts, params)) == ids(first)
    assert engine.pushes == pushes

    # a different model pushed in: samples and log-probs follow it; with min_p on, the reported
    # (raw, temperature-1) log-probs are the trainer's, so importance weights are about 1
    other, _ = tiny(hidden=256, heads=4, kv=2, seed=1)
    other = other.cuda().to(torch.bfloat16)
    engine.sync_weights(other)
    assert ids(engine.generate(prompts, params)) != ids(first)
    sampled = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, min_p=0.05, max_new_tokens=12, seed=1))
    completions = [c for g in sampled for c in g]
    batch = make_batch(completions, torch.device("cuda"), tokenizer.pad_token_id)
    train_logp, _ = score(PolicyHead(other), batch, 8, 1.0)
    engine_logp = torch.zeros_like(train_logp, dtype=torch.float32)
    for row, c in enumerate(completions):
        engine_logp[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
    mask = batch.completion_mask
    log_ratio = (train_logp.float() - engine_logp)[mask]
    assert log_ratio.abs().mean() < 0.05 and abs(log_ratio.exp().mean().item() - 1) < 0.05


# ------------------------------------------------------------------ what is pushed (no vLLM needed)


def test_pushed_weights_carry_checkpoint_names_and_come_in_buckets():
    from sage_train.models.lora import apply_lora
    from sage_train.rollout.vllm import policy_weights_for_vllm, weight_buckets

    model, _ = tiny()
    names = set(model.state_dict())
    plain = {name: t.detach().clone() for name, t in policy_weights_for_vllm(model)}
    assert set(plain) <= names and {n for n, _ in model.named_parameters()} <= set(plain)
    lora = apply_lora(model, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_()
    merged = dict(policy_weights_for_vllm(lora))
    assert set(merged) == set(plain)  # adapter factors folded in, base names restored
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], plain[q])  # the adapter's delta is in the pushed weight ...
    base = dict(lora.named_parameters())["base_model.model." + q.replace(".weight", ".base_layer.weight")]
    assert torch.equal(base, plain[q])  # ... and the base weight is untouched
    buckets = list(weight_buckets(merged.items(), bucket_bytes=64 * 1024))
    assert [n for b in buckets for n, _ in b] == list(merged)
    assert all(sum(t.nbytes for _, t in b) <= 64 * 1024 or len(b) == 1 for b in buckets)


# ---------------------------------------------------- how the engine is configured (no vLLM needed)


def test_the_engine_joins_a_torch_distributed_job_only(distributed):
    import subprocess
    import sys

    from sage_train.rollout.vllm import executor_backend

    assert executor_backend() == "external_launcher"  # training: the trainer's process group
    # a plain `sage-eval` process has no torch.distributed job (and no RANK): vLLM's default executor
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    code = "from sage_train.rollout.vllm import executor_backend; print(executor_backend())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["None"], result.stderr[-2000:]


def test_sampling_options_leave_top_k_to_vllm_when_off():
    from sage_train.rollout.vllm import sampling_options

    off = sampling_options(SamplingParams(n=2, top_p=0.9, min_p=0.05, max_new_tokens=5, stop=("\n",)), seed=3)
    assert "top_k" not in off  # vLLM's default is "off"; the value meaning off differs across versions
    assert off == dict(
        n=2,
        temperature=1.0,
        top_p=0.9,
        min_p=0.05,
        max_tokens=5,
        stop=["\n"],
        include_stop_str_in_output=True,
        logprobs=0,
        seed=3,
    )
    assert sampling_options(SamplingParams(top_k=20, logprobs=False))["top_k"] == 20
