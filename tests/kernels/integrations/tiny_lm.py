"""The integration tests' tiny language models: a character-level tokenizer (`build_tokenizer`) and
the config options of a 2-layer, 32-wide decoder for it (`tiny_decoder_options`)."""

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

CHARS = "abcdefghij+=0123456789 "
SPECIAL = ["<pad>", "<eos>", "<unk>"]


def build_tokenizer():
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_decoder_options(tokenizer) -> dict:
    """The config options of the tests' tiny decoders (hidden 32, 2 layers, untied head) for `tokenizer`."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
