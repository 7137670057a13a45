"""The tiny tokenizer a run saves beside its model (sft/, final/) loads back, through `AutoTokenizer`
as sage-eval and a resumed run load it, as the same class, encoding every text alike: a resumed run
trains with the tokenizer of the run it continues."""

import string

from tiny_models import tiny_model
from transformers import AutoTokenizer

from sage_train.models.loading import build_char_tokenizer, load_pretrained

TEXTS = [
    string.printable,
    "  12 + 345 = 357\n\n",
    "<eos>x<pad>y<unk>",
    "café, Ångström, e\u0301, 中文, emoji 🙂",  # outside the vocabulary
    "don't 'll 're \r\n\t tabs",  # what Qwen2's split pattern isolates
]


def test_the_saved_tokenizer_reloads_as_the_same_class_and_encodes_alike(tmp_path):
    tokenizer = build_char_tokenizer()
    tiny_model(tokenizer, layers=1).save_pretrained(tmp_path)  # a Qwen2 config.json beside it
    tokenizer.save_pretrained(tmp_path)
    _, resumed = load_pretrained(str(tmp_path))
    reread = AutoTokenizer.from_pretrained(tmp_path)
    for loaded in (resumed, reread):
        assert type(loaded) is type(tokenizer)
        assert loaded.get_vocab() == tokenizer.get_vocab()
        assert (loaded.pad_token_id, loaded.eos_token_id, loaded.padding_side) == (0, 1, "left")
        for text in TEXTS:
            assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"], text
        batch = [TEXTS[1], TEXTS[2]]
        assert loaded(batch, padding=True)["input_ids"] == tokenizer(batch, padding=True)["input_ids"]


def test_printable_ascii_is_one_token_per_character():
    tokenizer = build_char_tokenizer()
    text = "".join(c for c in string.printable if c.isprintable()) + "\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text
