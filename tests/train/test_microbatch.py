"""The gradient of one optimizer step does not depend on the micro-batch size.

Same model, same batch of completions (ragged lengths, some rows fully masked by overlong
filtering), micro-batches of 1 and of 4 rows, and packed micro-batches by a token budget, in a
real DeepSpeed engine (ZeRO-0, float32): the gradients DeepSpeed hands to the optimizer agree to
float32 rounding."""

import pytest
import torch
from tiny_models import completions, step_context, tiny_model

from sage_train.build import build_engines
from sage_train.inputs import engine_config, run_settings
from sage_train.models.loading import build_char_tokenizer
from sage_train.policy import make_batch, score
from sage_train.step import policy_update

CPU = torch.device("cpu")


def optimizer_step_gradients(cfg, tokenizer, batch, advantages, seed):
    model = tiny_model(tokenizer, seed=seed, max_positions=64)
    reference = tiny_model(tokenizer, seed=seed + 1, max_positions=64).requires_grad_(False)
    s = run_settings(cfg)
    engine, reference = build_engines(s.optim, model, reference, engine_config(s, 1, CPU), CPU, s.reward.beta != 0)
    captured = {}

    def capture(optimizer, args, kwargs):
        for name, p in engine.module.named_parameters():
            captured[name] = p.grad.detach().clone()

    engine.optimizer.register_step_pre_hook(capture)
    cpu, packed = torch.device("cpu"), cfg.padding_free
    ctx = step_context(cfg, engine, reference, tokenizer=tokenizer, device=cpu, padding_free=packed)
    old_logp, _ = score(engine, batch, 3, cfg.temperature)
    ref_logp, _ = score(reference, batch, 3, cfg.temperature)
    policy_update(ctx, batch, advantages, old_logp, ref_logp, None)
    return captured


@pytest.mark.parametrize(
    "algorithm, loss_type",
    [("sage-branch", None), ("dapo", None), ("dr_grpo", None), ("bnpo", None)]
    + [("sage-branch", loss_type) for loss_type in ("cispo", "sapo", "luspo", "vespo")],
)
def test_gradient_is_invariant_to_micro_batch_size(tiny_config, distributed, algorithm, loss_type):
    tokenizer = build_char_tokenizer()
    batch = make_batch(completions(tokenizer, 8, seed=1), torch.device("cpu"), tokenizer.pad_token_id)
    batch.completion_mask[5] = False  # a row dropped by overlong filtering
    advantages = torch.randn(8, generator=torch.Generator().manual_seed(2))
    grads = {}
    splits = {  # 8 rows of 58 tokens in all: the budget makes micro-batches of rows 5 7 | 0 1 2 | 3 4 6
        1: {"micro_batch_size": 1, "padding_free": False},
        4: {"micro_batch_size": 4, "padding_free": False},
        "24 tokens, packed": {"micro_batch_size": 4, "max_tokens_per_micro_batch": 24, "padding_free": True},
    }
    for split, keys in splits.items():
        cfg = tiny_config(
            algorithm=algorithm,
            loss_type=loss_type,
            prompts_per_step=2,
            group_size=4,
            max_grad_norm=0.0,
            temperature=0.8,
            max_new_tokens=8,
            **keys,
        )
        grads[split] = optimizer_step_gradients(cfg, tokenizer, batch, advantages, seed=3)
    for split in (4, "24 tokens, packed"):
        assert grads[1].keys() == grads[split].keys() and len(grads[1]) > 0
        for name in grads[1]:
            torch.testing.assert_close(grads[1][name], grads[split][name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(g.abs().max() > 1e-4 for g in grads[1].values())


@pytest.mark.parametrize("algorithm", ["sage-branch", "dapo"])
def test_an_update_moves_log_probs_with_the_advantage(tiny_config, distributed, algorithm):
    """After a few steps on one batch, completions with positive advantage became more likely and
    those with negative advantage less (the loss's sign, through the engine and the normalisers)."""
    tokenizer = build_char_tokenizer()
    cfg = tiny_config(algorithm=algorithm, prompts_per_step=2, group_size=4, micro_batch_size=4, lr=1e-3)
    model = tiny_model(tokenizer, seed=0, max_positions=64)
    reference = tiny_model(tokenizer, seed=0, max_positions=64).requires_grad_(False)
    s = run_settings(cfg)
    engine, reference = build_engines(s.optim, model, reference, engine_config(s, 1, CPU), CPU, s.reward.beta != 0)
    ctx = step_context(cfg, engine, reference, tokenizer=tokenizer)
    batch = make_batch(completions(tokenizer, 8, seed=1), torch.device("cpu"), tokenizer.pad_token_id)
    advantages = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0])
    before, _ = score(engine, batch, 4, cfg.temperature)
    for _ in range(3):
        old_logp, _ = score(engine, batch, 4, cfg.temperature)
        ref_logp, _ = score(reference, batch, 4, cfg.temperature)
        policy_update(ctx, batch, advantages, old_logp, ref_logp, None)
    after, _ = score(engine, batch, 4, cfg.temperature)
    change = ((after - before) * batch.completion_mask).sum(dim=1)
    assert (change[advantages > 0] > 0.1).all() and (change[advantages < 0] < -0.1).all(), change
