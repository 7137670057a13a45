"""Models and tokenizers: a tiny Qwen2-style model with a character-level tokenizer the
package builds itself (nothing downloaded), or a real model: a named model shipped by a package,
a GGUF file (both through `sage_train.packaged_models`), a hub name or a local path.

The tiny tokenizer maps each printable ASCII character and the newline to one token, plus
``<pad>``, ``<eos>`` and ``<unk>``; other characters are dropped. It is a `Qwen2Tokenizer`, the
class ``AutoTokenizer.from_pretrained`` gives a folder holding a Qwen2 config, so the tokenizer a
run saves beside its model (sft/, final/) loads back as the same class and encodes alike: a resumed
run trains with the tokenizer of the run it continues.
"""

from __future__ import annotations

import os
import string

import torch
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

from .model_files import ModelFilesError
from .packaged_models import model_directory

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
CHARACTERS = "\n" + "".join(c for c in string.printable if c.isprintable())


def build_char_tokenizer() -> Qwen2Tokenizer:
    """One token per character: Qwen2's byte-level BPE with an empty merge list never joins
    characters (space is stored as "Ġ", newline as "Ċ", as GPT-2 and Qwen2 do)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_char = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in CHARACTERS:
        vocab[byte_char[ord(char)]] = len(vocab)
    assert all(token in alphabet for token in list(vocab)[len(SPECIAL_TOKENS) :])
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=512,
    )


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet, in byte order)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def build_tiny_model(
    tokenizer,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_positions: int,
    seed: int,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 model sized by the arguments, vocabulary rounded up to 64."""
    vocab_size = -(-len(tokenizer) // 64) * 64
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def load_model_and_tokenizer(cfg):
    """The policy model and its tokenizer, per ``cfg.model``: "tiny" builds them from the
    ``tiny_*`` keys; anything else is a hub name or a local directory (HF format)."""
    if cfg.model == "tiny":
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(
            tokenizer,
            hidden_size=cfg.tiny_hidden_size,
            num_layers=cfg.tiny_layers,
            num_heads=cfg.tiny_heads,
            num_kv_heads=cfg.tiny_kv_heads,
            intermediate_size=cfg.tiny_intermediate_size,
            max_positions=cfg.tiny_max_positions,
            seed=cfg.seed,
        )
        return model, tokenizer
    return load_pretrained(cfg.model, cfg.gguf_file)


def load_pretrained(path: str, gguf_file: str = ""):
    """A causal LM and its tokenizer from a hub name, an HF-format directory, or a named model or
    GGUF file (`sage_train.packaged_models`: converted once to a cached HF directory, loaded from
    there). Float32 weights (DeepSpeed casts them to bf16 on GPU); left padding, and a pad token,
    for batched generation."""
    path = model_directory(path, gguf_file)
    if not os.path.isdir(path) and os.path.sep in path and not os.path.exists(path):
        raise FileNotFoundError(f"model: no directory {path!r} (expected 'tiny', a hub name or a local path)")
    tokenizer = load_tokenizer(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def load_tokenizer(path: str):
    """The tokenizer of a model directory or hub name, its folder's own code never run
    (``trust_remote_code=False``: a model folder is data); `ModelFilesError` in one line when it
    cannot be loaded (a damaged tokenizer file, custom code it would need)."""
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - tokenizers, transformers and the hub raise many kinds
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ModelFilesError(f"model {path!r}: its tokenizer cannot be loaded ({first})") from None


def decoder_of(model) -> torch.nn.Module:
    """The base transformer of a causal LM (its forward returns last hidden states, not logits)."""
    return getattr(model, model.base_model_prefix)
