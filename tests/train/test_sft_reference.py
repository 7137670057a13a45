"""The reference after a LoRA warm start: with ``sft_adapter: continue`` (the official SAGE way) RL
continues the warm start's adapter and the reference (adapter disabled) is the raw pre-SFT base;
with ``merge`` the reference is the warm-started model. A tiny real model, a real SFT, a real
DeepSpeed engine."""

import pytest
import torch

from sage_train.build import build_engines, initial_policy, policy_and_reference
from sage_train.inputs import check_inputs
from sage_train.models.loading import load_model_and_tokenizer
from sage_train.policy import PolicyHead, make_batch, score
from sage_train.rollout import SamplingParams, make_engine
from sage_train.tasks import get_task


def reference_and_models(tiny_config, tmp_path, adapter):
    cfg = tiny_config(
        name=adapter,
        lora_rank=4,
        lora_alpha=8.0,
        sft_steps=30,
        sft_lr=3e-2,
        sft_adapter=adapter,
        sft_batch_size=8,
        beta=0.05,
    )
    task = get_task(cfg.task, **cfg.task_options)
    problems = task.problems("train", None, cfg.seed)
    plan = check_inputs(cfg, world=1)
    s, with_reference = plan.settings, plan.settings.reward.beta != 0
    base, tokenizer = load_model_and_tokenizer(s.model)  # the same seeded weights the warm start begins from
    model, _ = initial_policy(plan, rank=0, resumed=False)
    policy, reference_lm = policy_and_reference(s.lora, model, with_reference)
    engine, reference = build_engines(
        s.optim, policy, reference_lm, plan.deepspeed, torch.device("cpu"), with_reference
    )
    groups = make_engine("hf", base, tokenizer).generate(
        [task.prompt(p) for p in problems[:4]], SamplingParams(n=2, max_new_tokens=6, seed=0)
    )
    batch = make_batch([c for g in groups for c in g], torch.device("cpu"), tokenizer.pad_token_id)
    logp = lambda scorer: score(scorer, batch, 8, 1.0)[0][batch.completion_mask]  # noqa: E731
    return logp(reference), logp(PolicyHead(base)), logp(engine)


@pytest.mark.parametrize("adapter", ["continue", "merge"])
def test_reference_after_a_lora_warm_start(tiny_config, distributed, tmp_path, adapter):
    reference, base, sft = reference_and_models(tiny_config, tmp_path, adapter)
    assert (sft - base).abs().max() > 0.05  # the warm start moved the model
    if adapter == "continue":
        torch.testing.assert_close(reference, base, rtol=0, atol=1e-5)
    else:
        torch.testing.assert_close(reference, sft, rtol=0, atol=1e-4)
        assert (reference - base).abs().max() > 0.05
