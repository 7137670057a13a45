"""The hf rollout engine on a tiny real transformers model, and the tokenizer the package builds."""

import torch
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from sage_train.model import build_char_tokenizer
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
    logp, entropy = score(PolicyHead(model), batch, micro_batch_size=4, temperature=0.7)
    for row, c in enumerate(completions):
        n = len(c.completion_ids)
        torch.testing.assert_close(logp[row, :n], torch.tensor(c.logprobs), atol=2e-5, rtol=1e-5)
        assert batch.completion_mask[row].sum() == n
    assert (entropy[batch.completion_mask] > 0).all()
