"""Models and tokenizers: a tiny Qwen2-style model with a character-level tokenizer the
package builds itself (nothing downloaded), or a real model: a named model shipped by a package,
a GGUF file (both through `sage_train.models.packaged`), a hub name or a local path.

The tiny tokenizer maps each printable ASCII character and the newline to one token, plus
``<pad>``, ``<eos>`` and ``<unk>``; other characters are dropped. It is a `Qwen2Tokenizer`, the
class ``AutoTokenizer.from_pretrained`` gives a folder holding a Qwen2 config, so the tokenizer a
run saves beside its model (sft/, final/) loads back as the same class and encodes alike: a resumed
run trains with the tokenizer of the run it continues.
"""

from __future__ import annotations

import inspect
import os
import string

import torch
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

from .files import ModelFilesError
from .lora import base_lm
from .packaged import model_directory

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


def tiny_model(cfg, tokenizer) -> Qwen2ForCausalLM:
    """The run's tiny model: `build_tiny_model` sized by the ``tiny_*`` keys, seeded by ``seed``."""
    return build_tiny_model(
        tokenizer,
        hidden_size=cfg.tiny_hidden_size,
        num_layers=cfg.tiny_layers,
        num_heads=cfg.tiny_heads,
        num_kv_heads=cfg.tiny_kv_heads,
        intermediate_size=cfg.tiny_intermediate_size,
        max_positions=cfg.tiny_max_positions,
        seed=cfg.seed,
    )


def tokenizer_for(source: str):
    """The tokenizer of a model source: the character tokenizer for "tiny", else the directory's or
    hub name's (`pretrained_tokenizer`)."""
    return build_char_tokenizer() if source == "tiny" else pretrained_tokenizer(source)


def model_for(cfg, source: str, tokenizer):
    """The model of a source (`packaged.model_directory`'s answer): "tiny" builds it
    (`tiny_model`), anything else is loaded (`load_weights`)."""
    return tiny_model(cfg, tokenizer) if source == "tiny" else load_weights(source, tokenizer)


def load_skeleton(cfg, source: str, tokenizer):
    """The model of a source without weights (the meta device): its modules, to check names against."""
    from transformers import AutoConfig

    with torch.device("meta"):
        if source == "tiny":
            return tiny_model(cfg, tokenizer)
        config = AutoConfig.from_pretrained(source, trust_remote_code=False)
        return AutoModelForCausalLM.from_config(config, trust_remote_code=False)


def load_model_and_tokenizer(cfg):
    """The policy model and its tokenizer, per ``cfg.model``: "tiny" builds them from the
    ``tiny_*`` keys; anything else is a hub name or a local directory (HF format)."""
    source = model_directory(cfg.model, cfg.gguf_file)
    tokenizer = tokenizer_for(source)
    return model_for(cfg, source, tokenizer), tokenizer


def load_pretrained(path: str, gguf_file: str = ""):
    """A causal LM and its tokenizer from a hub name, an HF-format directory, or a named model or
    GGUF file (`sage_train.models.packaged`: converted once to a cached HF directory, loaded from
    there)."""
    return load_folder(model_directory(path, gguf_file))


def load_folder(path: str):
    """A causal LM and its tokenizer from a hub name or an HF-format directory as it is (a folder a
    run saved, or `model_directory`'s answer)."""
    tokenizer = pretrained_tokenizer(path)
    return load_weights(path, tokenizer), tokenizer


def pretrained_tokenizer(path: str):
    """The tokenizer of a hub name or an HF-format directory, with left padding and a pad token,
    for batched generation."""
    if not os.path.isdir(path) and os.path.sep in path and not os.path.exists(path):
        raise FileNotFoundError(f"model: no directory {path!r} (expected 'tiny', a hub name or a local path)")
    tokenizer = load_tokenizer(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_weights(path: str, tokenizer):
    """The causal LM of a hub name or an HF-format directory, float32 (DeepSpeed casts it to bf16
    on GPU), its generation padded with `tokenizer`'s pad token."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


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


def packs_sequences(lm) -> bool:
    """Whether `lm` computes sequences packed back to back in one row (positions restarting at 0 for
    each, no attention mask) as it computes each alone: its positions come from ``position_ids`` and
    its attention never crosses from one sequence into another (`sage_train.micro_batches`).

    Probed, not looked up: a sequence of 3 random tokens after one of 5, against it alone, with the
    model's own attention implementation, without gradient. transformers' decoders that build their
    attention mask from ``position_ids`` (``masking_utils``: Llama and SmolLM2, Qwen2/2.5/3, Mistral,
    Gemma 2/3, Phi-3, OLMo 2, Cohere, GPT-2, GPT-NeoX, OPT, Falcon, ...) pass: eager, sdpa and flex
    attention get a block-diagonal causal mask, flash-attention its varlen kernel with the sequence
    boundaries read from ``position_ids``. A model without ``position_ids`` (Bloom's ALiBi) does not.
    A leak would move the second sequence's hidden states by about their own size; rounding (float32,
    or the summation order of a longer row) moves them by far less than the 1% allowed."""
    decoder = decoder_of(base_lm(lm))  # under LoRA: the layers that carry the adapter
    if "position_ids" not in inspect.signature(decoder.forward).parameters:
        return False
    weight = decoder.get_input_embeddings().weight
    draw = torch.Generator().manual_seed(0)
    first, second = (torch.randint(weight.shape[0], (1, n), generator=draw).to(weight.device) for n in (5, 3))
    training = decoder.training
    decoder.eval()  # no dropout in the probe
    try:
        with torch.no_grad():
            alone = decoder(input_ids=second, position_ids=torch.arange(3, device=weight.device)[None], use_cache=False)
            positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]], device=weight.device)
            packed = decoder(input_ids=torch.cat([first, second], 1), position_ids=positions, use_cache=False)
    finally:
        decoder.train(training)
    alone, packed = alone.last_hidden_state.float(), packed.last_hidden_state[:, 5:].float()
    return bool((packed - alone).abs().max() <= 1e-2 * alone.abs().max())
