"""LoRA through peft on a tiny Qwen2 model with a real DeepSpeed engine (CPU): training steps
change the adapter only, the reference (adapter disabled) is the base model, the LM head gets
no gradient; the whole loop runs with LoRA and with the truncated-IS correction."""

import copy
import dataclasses
import json

import pytest
import safetensors.torch
import torch
from tiny_models import step_context
from transformers import AutoModelForCausalLM

from sage_train import checkpoint, report
from sage_train.build import build_engines
from sage_train.inputs import engine_config, run_settings
from sage_train.models.loading import load_model_and_tokenizer
from sage_train.models.lora import AdapterDisabled, is_lora, with_lora
from sage_train.policy import PolicyHead, make_batch, score
from sage_train.rl_maths import rollout_correction
from sage_train.rollout import SamplingParams, make_engine
from sage_train.run import train
from sage_train.step import policy_update
from sage_train.tasks import get_task

pytest.importorskip("peft")


def lora_setup(tiny_config, distributed, **overrides):
    cfg = tiny_config(lora_rank=4, lora_alpha=8.0, lr=0.05, zero_stage=overrides.pop("zero_stage", 0), **overrides)
    rank, world, device = distributed
    s = run_settings(cfg)
    model, tokenizer = load_model_and_tokenizer(s.model)
    base = copy.deepcopy(model).eval()
    model = with_lora(model, s.lora)
    engine, reference = build_engines(s.optim, model, None, engine_config(s, world, device), device, s.reward.beta != 0)
    rollout = make_engine("hf", engine.module.lm, tokenizer, device=device)
    task = get_task("arithmetic", digits=1)
    problems = list(task.problems("train", 16, 0))
    ctx = step_context(
        cfg,
        engine,
        reference,
        rollout=rollout,
        tokenizer=tokenizer,
        task=task,
        problems=problems,
        rank=rank,
        world=world,
        device=device,
    )
    return ctx, base


def rollout_batch(ctx):
    prompts = [ctx.task.prompt(p) for p in ctx.train_problems[:4]]
    groups = ctx.rollout.generate(prompts, SamplingParams(n=4, max_new_tokens=4, seed=1))
    completions = [c for g in groups for c in g]
    return completions, make_batch(completions, ctx.device, ctx.tokenizer.pad_token_id)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_lora_steps_train_the_adapter_only(tiny_config, distributed, zero_stage):
    ctx, base = lora_setup(tiny_config, distributed, zero_stage=zero_stage)
    lm = ctx.engine.module.lm
    assert is_lora(lm) and isinstance(ctx.reference, AdapterDisabled)
    head = lm.get_output_embeddings()
    assert not head.weight.requires_grad
    before = {name: p.detach().clone() for name, p in lm.named_parameters()}
    trainable = {name for name, p in lm.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)

    completions, batch = rollout_batch(ctx)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        advantages = torch.randn(batch.rows, generator=generator)
        old_logp, _ = score(ctx.engine, batch, 8, 1.0)
        ref_logp, _ = score(ctx.reference, batch, 8, 1.0)
        policy_update(ctx, batch, advantages, old_logp, ref_logp, None)

    changed = {name for name, p in lm.named_parameters() if not torch.equal(p.detach(), before[name])}
    assert changed and changed <= trainable, sorted(changed - trainable)
    assert any("lora_B" in name for name in changed)

    # the reference is the base model: the adapter disabled gives the untouched model's log-probs
    ref_logp, _ = score(ctx.reference, batch, 8, 1.0)
    base_logp, _ = score(PolicyHead(base), batch, 8, 1.0)
    policy_logp, _ = score(ctx.engine, batch, 8, 1.0)
    torch.testing.assert_close(ref_logp, base_logp, atol=1e-5, rtol=1e-5)
    assert (policy_logp - base_logp)[batch.completion_mask].abs().max() > 1e-4


def test_lora_head_gets_no_gradient(tiny_config, distributed):
    ctx, _ = lora_setup(tiny_config, distributed)
    policy = ctx.engine.module
    completions, batch = rollout_batch(ctx)
    old_logp, _ = score(ctx.engine, batch, 8, 1.0)
    loss, _ = policy(
        **batch.model_inputs(slice(0, batch.rows), 1.0),
        loss_inputs={
            "mask": batch.completion_mask,
            "advantages": torch.randn(batch.rows),
            "old_logp": old_logp,
            "ref_logp": old_logp,
            "config": ctx.loss,
        },
    )
    loss.backward()
    head = policy.lm.get_output_embeddings()
    assert head.weight.grad is None
    lora_grads = [p.grad for n, p in policy.lm.named_parameters() if "lora_A" in n]
    assert lora_grads and all(g is not None for g in lora_grads)
    policy.zero_grad(set_to_none=True)


def test_tis_weights_with_hf_engine_are_one(tiny_config, distributed):
    ctx, _ = lora_setup(tiny_config, distributed, tis_level="token", tis_cap=2.0)
    completions, batch = rollout_batch(ctx)
    train_logp, _ = score(ctx.engine, batch, 8, 1.0)
    corrections, engine = ctx.settings.corrections, ctx.settings.rollout.rollout_engine
    weights, metrics = rollout_correction(corrections, engine, completions, train_logp, batch)
    assert weights.shape == batch.completion_mask.shape
    torch.testing.assert_close(weights, torch.ones_like(weights), atol=1e-4, rtol=0)
    assert abs(float(metrics["tis/weight_mean"]) - 1) < 1e-4
    off = dataclasses.replace(corrections, tis_level="off")
    assert rollout_correction(off, engine, completions, train_logp, batch) == (None, {})


def test_lora_loop_end_to_end(tiny_config, distributed):
    cfg = tiny_config(name="lora", lora_rank=4, steps=2, sft_steps=3, tis_level="sequence", tis_cap=3.0, save_every=2)
    summary = train(cfg)
    rows = report.read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert abs(row["tis/weight_mean"] - 1) < 1e-3
        assert "rollout/sync_time" not in row  # the hf engine samples from the live model: no sync
    final = cfg.run_dir / "final"
    assert (final / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(final)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert summary["steps_done"] == 2


def test_merged_weights_out_of_place(tiny_config):
    from sage_train.models.lora import merged_named_weights
    from sage_train.rollout.vllm import policy_weights_for_vllm, weight_buckets

    s = run_settings(tiny_config(lora_rank=4))
    model, _ = load_model_and_tokenizer(s.model)
    plain_before = {name: p.detach().clone() for name, p in model.named_parameters()}
    plain_names = set(plain_before)
    model = with_lora(model, s.lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # a trained adapter (B starts at zero)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    weights = dict(merged_named_weights(model))
    assert set(weights) == plain_names
    reference = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, reference[name].detach())
    changed = {n for n in weights if not torch.equal(weights[n], plain_before[n])}
    assert changed and all(n.endswith("proj.weight") for n in changed)  # the adapted layers only
    for name, p in model.named_parameters():  # the frozen base weights were not touched
        if "lora_" not in name:
            assert torch.equal(p.detach(), base_before[name])
    buckets = list(weight_buckets(policy_weights_for_vllm(model), 64 << 10))
    assert len(buckets) > 1 and sum(len(b) for b in buckets) == len(plain_names)


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_two_processes(tmp_path, tiny_run, stage):
    """LoRA under ZeRO-2 and ZeRO-3 with two CPU processes (torchrun, gloo): the run finishes
    and saves the adapter and a loadable merged model."""
    import json
    import os
    import socket
    import subprocess
    import sys

    import yaml

    config = {
        **tiny_run,
        "name": f"lora-zero{stage}",
        "output_dir": str(tmp_path),
        "steps": 2,
        "sft_steps": 2,
        "zero_stage": stage,
        "prompts_per_step": 4,
        "micro_batch_size": 4,
        "lora_rank": 4,
        "tis_level": "token",
    }
    if stage == 3:  # partition every parameter, the adapter and the tiny LM head included
        ds_path = tmp_path / "ds.json"
        ds_path.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
        config["deepspeed_config"] = str(ds_path)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
    ]
    command += ["-m", "sage_train", "--config", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    run = tmp_path / f"lora-zero{stage}"
    assert [row["step"] for row in report.read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert (run / "final" / "adapter" / "adapter_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert model.lm_head.weight.shape[1] == tiny_run["tiny_hidden_size"]


def test_lora_checkpoints_hold_the_adapter_not_the_base_and_load_back(tiny_config, distributed):
    options = dict(name="lora-ckpt", save_every=1, keep_checkpoints=0, log_completions=2, steps=2)
    cfg = tiny_config(lora_rank=4, **options)
    train(cfg)
    (states,) = (cfg.run_dir / "checkpoints").glob("*2/*model_states.pt")
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]
    assert module and all("lora_" in name for name in module)
    ctx, _ = lora_setup(tiny_config, distributed, **options)  # a fresh adapter on the same base
    assert checkpoint.load(ctx.engine, [states.parent], [], None) == 2
    trained = safetensors.torch.load_file(cfg.run_dir / "final" / "adapter" / "adapter_model.safetensors")
    loaded = {n: p for n, p in ctx.engine.module.lm.named_parameters() if "lora_" in n}
    assert len(trained) == len(loaded)
    for name, value in trained.items():
        torch.testing.assert_close(loaded[name.replace(".weight", ".default.weight")], value, rtol=0, atol=0)
    rows = [json.loads(line) for line in (cfg.run_dir / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2, 2]
    assert all(len(r["completions"]) == len(r["rewards"]) == cfg.group_size for r in rows)
