"""The hf engine's prompt left-truncation (``max_prompt_length``) and stop strings (``stop``), on a
tiny real model: the tokens kept, and where a completion ends."""

from tiny_models import tiny_model

from sage_train.models.loading import build_char_tokenizer
from sage_train.rollout import SamplingParams, make_engine

DIGITS = tuple("0123456789")


def test_long_prompts_lose_their_start():
    tokenizer = build_char_tokenizer()
    engine = make_engine("hf", tiny_model(tokenizer), tokenizer)
    groups = engine.generate(["123+456=", "5="], SamplingParams(n=1, max_new_tokens=3, seed=0, max_prompt_tokens=4))
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert groups[0][0].prompt_ids == ids("456=") and groups[1][0].prompt_ids == ids("5=")


def test_stop_strings_end_completions_even_when_the_pad_token_is_eos():
    for pad_is_eos in (False, True):
        tokenizer = build_char_tokenizer()
        if pad_is_eos:
            tokenizer.pad_token = tokenizer.eos_token
        engine = make_engine("hf", tiny_model(tokenizer, seed=2), tokenizer)
        groups = engine.generate(["1+2="] * 4, SamplingParams(n=4, max_new_tokens=40, seed=1, stop=DIGITS))
        completions = [c for group in groups for c in group]
        stopped = [c for c in completions if c.finish_reason == "stop" and c.text and c.text[-1] in DIGITS]
        assert len(stopped) >= 4, [c.text for c in completions]  # a random model over ~100 characters
        for c in completions:
            assert len(c.logprobs) == len(c.completion_ids)
            if c.finish_reason == "length":
                assert not any(d in c.text for d in DIGITS) and len(c.completion_ids) == 40
            elif c.completion_ids[-1] == tokenizer.eos_token_id:  # ended by EOS itself
                assert not any(d in c.text for d in DIGITS)
            else:  # ended at its first digit, the digit kept, nothing after it
                assert c.text[-1] in DIGITS and not any(d in c.text[:-1] for d in DIGITS), c.text
                assert tokenizer.eos_token_id not in c.completion_ids
