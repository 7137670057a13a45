"""The files of a model that sage-train starts from or sage-eval samples: checked before anything is
built from them, and fingerprinted, so that samples are never credited to another model's weights.

`check_model` says in one line what is wrong with a model directory (missing or invalid config.json,
a config that needs the folder's own code, no weights, a truncated or garbled safetensors file, a
pickled weight file that would build anything but tensors, a tokenizer.json the tokenizers library
cannot read) or a hub name that does not resolve, before transformers meets it. A model folder is
data: nothing here or in `sage_train.models.loading` runs its code (``trust_remote_code=False``) or unpickles
more than tensors. `fingerprint` is a digest of every file of a model directory (weights,
config, tokenizer, adapter): the same bytes give the same fingerprint wherever the folder lies.
Every file of a model folder must be a regular file (a link to one is fine, as in the hub's cache):
a FIFO blocks whoever opens it, a link to /dev/zero never ends, so both are refused by name before
any file of the folder is opened (`model_files`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from ..errors import NotAFileError
from ..safe_files import check_regular, parse_json, read_bytes

#: weight files transformers loads (safetensors, or a PyTorch pickle, checked by `pickle_problem`)
WEIGHT_SUFFIXES = (".safetensors", ".bin")
_SAFETENSORS_HEADER_MAX = 100 << 20  # the format's own limit on its JSON header
_CONFIG_MAX = 16 << 20  # config.json, adapter_config.json: a few kB


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
    try:
        for _ in model_files(path):  # each one checked before any is opened
            pass
    except NotAFileError as error:
        raise ModelFilesError(f"{what}: {error}") from None
    configs = [path / "config.json", path / "adapter_config.json"]
    config = next((c for c in configs if c.is_file()), None)
    if config is None:
        raise ModelFilesError(f"{what}: no config.json in {name_or_path!r} (not an HF model directory)")
    try:
        values = parse_json(read_bytes(config, _CONFIG_MAX), config)
    except (OSError, ValueError) as error:
        raise ModelFilesError(f"{what}: {config} cannot be read: {error}") from None
    if not isinstance(values, dict):
        raise ModelFilesError(f"{what}: {config} must hold a JSON object")
    if config.name == "config.json":
        _check_config(path, what)
    weights = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not weights:
        raise ModelFilesError(f"{what}: no weights (*.safetensors or *.bin) in {name_or_path!r}")
    for file in weights:
        problem = safetensors_problem(file) if file.suffix == ".safetensors" else pickle_problem(file)
        if problem:
            raise ModelFilesError(f"{what}: {file} {problem}")
    if (path / "tokenizer.json").is_file():
        problem = tokenizer_problem(path / "tokenizer.json")
        if problem:
            raise ModelFilesError(f"{what}: {path / 'tokenizer.json'} {problem}")


def _check_config(path: Path, what: str) -> None:
    """The folder's config as transformers reads it, its own code never run (``trust_remote_code=False``:
    a model folder is data; a config whose ``auto_map`` names code in the folder is refused)."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - transformers raises ValueError, KeyError, OSError... here
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise ModelFilesError(
            f"{what}: {path / 'config.json'} cannot be loaded without running code from the folder, which sage "
            f"never does, or not at all ({first})"
        ) from None


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
        except RecursionError:
            return "has a header nested too deeply to be read (not a safetensors file)"
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "has a garbled header (not a safetensors file)"
    if 8 + header_len + end != size:
        return f"is truncated: its header promises {8 + header_len + end} bytes, the file has {size}"
    return None


def pickle_problem(file: Path) -> str | None:
    """Why the PyTorch weight file `file` (a pickle) is refused, or None: found by reading its
    pickle's opcodes, never by unpickling it (`torch.serialization.get_unsafe_globals_in_checkpoint`),
    it may build tensors and plain containers only."""
    import torch

    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(file))
    except Exception:  # noqa: BLE001 - not a zip, a damaged one, a bad pickle: all refused alike
        return "is not a torch.save zip checkpoint (damaged, or an older pickle format); save it as safetensors"
    if unsafe:
        return (
            f"holds Python objects other than tensors and plain data ({', '.join(sorted(unsafe))}); loading "
            f"it could run code, so it is refused"
        )
    return None


def tokenizer_problem(file: Path) -> str | None:
    """Why `file` (a tokenizer.json) cannot be loaded by the tokenizers library, or None."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(file))
    except Exception as error:  # noqa: BLE001 - the Rust library raises a bare Exception
        return f"is not a tokenizer the tokenizers library reads ({(str(error).splitlines() or [''])[0][:200]})"
    return None


def _check_hub_name(name: str, what: str) -> None:
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name, trust_remote_code=False)
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
    digest = hashlib.sha256()
    for file in model_files(root, skip):
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size  # read to this size only: a file that keeps growing cannot stall us
            digest.update(f"{file.relative_to(root).as_posix()}\0{size}\0".encode())
            part, offset = hashlib.sha256(), 0
            while offset < size and (chunk := os.pread(fd, min(1 << 22, size - offset), offset)):
                part.update(chunk)
                offset += len(chunk)
            digest.update(part.digest())
        finally:
            os.close(fd)
    return digest.hexdigest()


def model_files(root: Path, skip: Path | None = None):
    """Every file under the model folder `root` (sorted; hidden ones and the folder `skip` left out),
    each checked to be a regular file, links followed, before it is yielded: `NotAFileError` naming
    the first FIFO, device, socket or dangling link."""
    skip = skip.resolve() if skip is not None else None
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".") and Path(folder, d).resolve() != skip)
        for name in sorted(f for f in files if not f.startswith(".")):
            yield check_regular(Path(folder, name))
