"""A tiny Qwen2 causal LM and a character-level tokenizer, saved to a temporary folder (no network)."""

import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

# tests/kernels' helpers (tolerances.py) are importable from here too, whatever was collected first
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    """Path of a saved tiny Qwen2 model and its tokenizer (vocab 26, hidden 32, 2 layers)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**tiny_decoder_options(tokenizer))).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
