"""The hf rollout engine on a tiny real transformers model, and the tokenizer the package builds."""

import torch
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from sage_train.models.loading import build_char_tokenizer
from sage_train.policy import PolicyHead, make_batch, score
from sage_train.rollout import SamplingParams, make_engine


def test_char_tokenizer_round_trips_and_reloads(tmp_path):
    tokenizer = build_char_tokenizer()
    text = "Compute 12+34.\nAnswer: \\boxed{46}"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text
    tokenizer.save_pretrained(tmp_path)
    tiny_model(tokenizer).save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text, add_special_tokens=False)["input_ids"] == ids and again.padding_side == "left"
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.vocab_size >= len(tokenizer)


def test_seeded_sampling_is_reproducible_and_cut_at_eos():
    tokenizer = build_char_tokenizer()
    engine = make_engine("hf", tiny_model(tokenizer), tokenizer)
    params = SamplingParams(n=3, max_new_tokens=12, seed=5)
    first = engine.generate(["1+2=", "31+40="], params)
    again = engine.generate(["1+2=", "31+40="], params)
    assert [[c.completion_ids for c in g] for g in first] == [[c.completion_ids for c in g] for g in again]
    for index, group in enumerate(first):
        assert len(group) == 3
        for c in group:
            assert c.prompt_index == index and len(c.logprobs) == len(c.completion_ids) <= 12
            eos_at = [i for i, t in enumerate(c.completion_ids) if t == tokenizer.eos_token_id]
            assert eos_at in ([], [len(c.completion_ids) - 1])
            assert c.finish_reason == ("stop" if eos_at else "length")


def test_engine_logprobs_equal_the_fused_scoring_of_the_same_tokens():
    """The training side (hidden states + LM head, with left padding and position ids) sees the
    distribution the engine sampled from."""
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    model = tiny_model(tokenizer, seed=1)
    engine = make_engine("hf", model, tokenizer)
    groups = engine.generate(
        ["7+8=", "123+456=", "5="], SamplingParams(n=2, max_new_tokens=10, temperature=0.7, seed=3)
    )
    completions = [c for group in groups for c in group]
    batch = make_batch(completions, torch.device("cpu"), tokenizer.pad_token_id)
    logp, entropy = score(PolicyHead(model), batch, micro_batches=4, temperature=0.7)
    for row, c in enumerate(completions):
        n = len(c.completion_ids)
        torch.testing.assert_close(logp[row, :n], torch.tensor(c.logprobs), atol=2e-5, rtol=1e-5)
        assert batch.completion_mask[row].sum() == n
    assert (entropy[batch.completion_mask] > 0).all()


def test_bfloat16_engine_samples_a_fresh_copy_and_reports_its_own_logprobs():
    """dtype=bfloat16 samples from a copy of the live model refreshed at every call (never stale),
    leaves the live model in float32, and reports the log-probs of the distribution it sampled,
    which the float32 trainer's scoring of the same tokens matches to bfloat16 precision."""
    tokenizer = build_char_tokenizer()
    model = tiny_model(tokenizer, seed=2)
    engine = make_engine("hf", model, tokenizer, dtype=torch.bfloat16)
    prompts, params = ["7+8=", "123+456="], SamplingParams(n=3, max_new_tokens=10, seed=4)
    completions = [c for group in engine.generate(prompts, params) for c in group]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    batch = make_batch(completions, torch.device("cpu"), tokenizer.pad_token_id)
    logp, _ = score(PolicyHead(model), batch, micro_batches=6, temperature=1.0)
    engine_logp = torch.zeros_like(logp)
    for row, c in enumerate(completions):
        engine_logp[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
    gap = (logp - engine_logp)[batch.completion_mask].abs()
    assert 0 < gap.max() < 0.1 and gap.mean() < 0.03  # bfloat16, not float32: they differ, a little

    with torch.no_grad():  # the live weights move (an optimizer step): the next call samples the new ones
        model.lm_head.weight.mul_(3.0)
    moved = [[c.completion_ids for c in g] for g in engine.generate(prompts, params)]
    fresh = make_engine("hf", model, tokenizer, dtype=torch.bfloat16).generate(prompts, params)
    assert moved == [[c.completion_ids for c in g] for g in fresh]
    assert moved != [[c.completion_ids for c in completions[i * 3 : i * 3 + 3]] for i in range(2)]
