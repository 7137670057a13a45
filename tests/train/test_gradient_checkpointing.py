"""Activation checkpointing of the decoder layers (``gradient_checkpointing``) changes where the
update's activations live, not its gradient: one optimizer step's gradients (full fine-tuning and
LoRA, a real DeepSpeed engine) equal those without it, while each layer's attention runs twice per
micro-batch (the forward, then its recompute in the backward) and once when only scoring."""

import copy

import pytest
import torch
from tiny_models import completions, step_context, tiny_model

from sage_train.build import build_engines
from sage_train.inputs import engine_config, run_settings
from sage_train.models.loading import build_char_tokenizer, decoder_of
from sage_train.models.lora import with_lora
from sage_train.policy import make_batch, score
from sage_train.step import policy_update

CPU = torch.device("cpu")


def step_gradients(cfg, tokenizer, batch, advantages):
    """(gradients handed to the optimizer by name, attention calls during scoring, during the update)."""
    model = tiny_model(tokenizer, seed=3, max_positions=64)
    reference, s = None, run_settings(cfg)
    if cfg.lora_rank:
        torch.manual_seed(5)  # peft draws the adapter's A from the global generator
        model = with_lora(model, s.lora)
    else:
        reference = tiny_model(tokenizer, seed=4, max_positions=64).requires_grad_(False)
    engine, reference = build_engines(s.optim, model, reference, engine_config(s, 1, CPU), CPU, s.reward.beta != 0)
    captured, calls = {}, []
    engine.optimizer.register_step_pre_hook(
        lambda *_: captured.update(
            {n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None}
        )
    )
    layers = decoder_of(engine.module.lm.get_base_model() if cfg.lora_rank else engine.module.lm).layers
    layers[0].self_attn.register_forward_pre_hook(lambda *_: calls.append(1))
    ctx = step_context(cfg, engine, reference, tokenizer=tokenizer)
    old_logp, _ = score(engine, batch, cfg.micro_batch_size, cfg.temperature)
    ref_logp, _ = score(reference, batch, cfg.micro_batch_size, cfg.temperature)
    scoring_calls = len(calls)
    policy_update(ctx, batch, advantages, old_logp, ref_logp, None)
    return captured, scoring_calls, len(calls) - scoring_calls


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_checkpointing_keeps_the_gradient(tiny_config, distributed, lora_rank):
    tokenizer = build_char_tokenizer()
    batch = make_batch(completions(tokenizer, 8, seed=1), torch.device("cpu"), tokenizer.pad_token_id)
    advantages = torch.randn(8, generator=torch.Generator().manual_seed(2))
    runs = {}
    for checkpointing in (False, True):
        cfg = tiny_config(
            algorithm="sage-branch",
            prompts_per_step=2,
            group_size=4,
            micro_batch_size=4,
            max_grad_norm=0.0,
            max_new_tokens=8,
            lora_rank=lora_rank,
            gradient_checkpointing=checkpointing,
        )
        runs[checkpointing] = step_gradients(cfg, tokenizer, batch, advantages)
    (plain, plain_scoring, plain_update), (ckpt, ckpt_scoring, ckpt_update) = runs[False], runs[True]
    micro_batches = 2
    # scoring (no autograd) runs each layer once per micro-batch, checkpointed or not: the policy's
    # scoring, and under LoRA the reference's too (the same layers with the adapter disabled)
    assert plain_scoring == ckpt_scoring == micro_batches * (2 if lora_rank else 1)
    assert plain_update == micro_batches and ckpt_update == 2 * micro_batches
    assert plain.keys() == ckpt.keys() and len(plain) > 0
    assert all(("lora_" in name) == bool(lora_rank) for name in plain)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)
    assert any(g.abs().max() > 1e-4 for g in plain.values())


def test_a_copy_of_a_checkpointed_model_runs_its_own_layers(tiny_config, distributed):
    """The hf engine samples from a deepcopy in bf16: the copy's layers must run the copy's weights."""
    tokenizer = build_char_tokenizer()
    cfg = tiny_config(gradient_checkpointing=True, prompts_per_step=2, group_size=4, micro_batch_size=4)
    s = run_settings(cfg)
    model = tiny_model(tokenizer, seed=3, max_positions=64)
    engine, _ = build_engines(s.optim, model, None, engine_config(s, 1, CPU), CPU, s.reward.beta != 0)
    lm = engine.module.lm
    replica = copy.deepcopy(lm)
    assert decoder_of(replica).layers[0].forward.__self__ is decoder_of(replica).layers[0]
    with torch.no_grad():
        for p in replica.parameters():
            p.zero_()
        ids = torch.tensor([[5, 6, 7]])
        assert not torch.equal(replica(ids).logits, lm(ids).logits)  # zeroed weights: the copy's output differs
