"""The files of a model that sage-train starts from or sage-eval samples: checked before anything is
built from them, and fingerprinted, so that samples are never credited to another model's weights.

`check_model` says in one line what is wrong with a model directory (missing or invalid config.json,
no weights, a truncated or garbled safetensors file) or a hub name that does not resolve, before
transformers meets it. `fingerprint` is a digest of every file of a model directory (weights,
config, tokenizer, adapter): the same bytes give the same fingerprint wherever the folder lies.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

#: weight files transformers loads (safetensors, or a PyTorch pickle it reads with weights_only)
WEIGHT_SUFFIXES = (".safetensors", ".bin")
_SAFETENSORS_HEADER_MAX = 100 << 20  # the format's own limit on its JSON header


class ModelFilesError(ValueError):
    """A model directory or name that cannot load; the message is one line naming the file."""


def check_model(name_or_path: str, what: str) -> None:
    """Raise `ModelFilesError` ("{what}: {the problem}") unless `name_or_path` is a loadable HF model
    directory (or adapter directory, whose base is named in adapter_config.json) or a hub name that
    resolves."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        if path.exists() or name_or_path.startswith(("/", ".", "~")):
            raise ModelFilesError(f"{what}: no directory {name_or_path!r}")
        _check_hub_name(name_or_path, what)
        return
    configs = [path / "config.json", path / "adapter_config.json"]
    config = next((c for c in configs if c.is_file()), None)
    if config is None:
        raise ModelFilesError(f"{what}: no config.json in {name_or_path!r} (not an HF model directory)")
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ModelFilesError(f"{what}: {config} is not valid JSON ({error})") from None
    if not isinstance(values, dict):
        raise ModelFilesError(f"{what}: {config} must hold a JSON object")
    weights = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not weights:
        raise ModelFilesError(f"{what}: no weights (*.safetensors or *.bin) in {name_or_path!r}")
    for file in weights:
        problem = safetensors_problem(file) if file.suffix == ".safetensors" else None
        if problem:
            raise ModelFilesError(f"{what}: {file} {problem}")


def safetensors_problem(file: Path) -> str | None:
    """Why `file` is not a whole safetensors file (its header, and the data it promises), or None."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes)"
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(_SAFETENSORS_HEADER_MAX, size - 8):
            return f"is truncated or not a safetensors file (a header of {header_len} bytes in {size})"
        try:
            header = json.loads(f.read(header_len))
            end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "has a garbled header (not a safetensors file)"
    if 8 + header_len + end != size:
        return f"is truncated: its header promises {8 + header_len + end} bytes, the file has {size}"
    return None


def _check_hub_name(name: str, what: str) -> None:
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise ModelFilesError(
            f"{what}: {name!r} is neither a local model directory nor a hub model that resolves "
            f"({str(error).splitlines()[0]})"
        ) from None


def fingerprint(name_or_path: str, skip: Path | None = None) -> str:
    """sha256 of a model directory: every file under it (its relative path and bytes, files reached
    through links included, hidden ones and the folder `skip` left out). For a hub name, the files of
    its cached snapshot, whose revision the name alone does not fix."""
    root = Path(name_or_path).expanduser()
    if not root.is_dir():
        from huggingface_hub import snapshot_download

        root = Path(snapshot_download(name_or_path, local_files_only=True))
    skip = skip.resolve() if skip is not None else None
    digest = hashlib.sha256()
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".") and Path(folder, d).resolve() != skip)
        for name in sorted(f for f in files if not f.startswith(".")):
            file = Path(folder, name)
            digest.update(f"{file.relative_to(root).as_posix()}\0{file.stat().st_size}\0".encode())
            with open(file, "rb") as f:
                digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()
