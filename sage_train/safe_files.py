"""Writing inside a folder that someone else may have made: a run directory, sage-eval's --out, a
study's --out. Such a folder is data: nothing in it may make sage write outside it, so no file in it
is ever opened through a symbolic link. This module is the one home of every write there:

- `write_file`: a whole file is written to a new temporary file beside it (made as mkstemp makes
  one: a random name, ``O_CREAT | O_EXCL | O_NOFOLLOW``, but with an ordinary file's permissions),
  then renamed over the name: a link there is replaced, never followed (`save_figure` for plots);
- `open_append`, `open_lock`: logs that grow and lock files are opened with ``O_NOFOLLOW``, and
  must be regular files (a link, a folder or a FIFO there is refused: `RunDirError`);
- `make_dir` makes a folder and refuses a link in its place; `fresh_dir` makes a staging folder
  anew, so that what a library saves into it (DeepSpeed, transformers) lands inside it;
- `remove` deletes a file, link or tree, never following a link (a link goes, its target stays);
- `refuse_links`: before a command touches such a folder, any link among the entries it will write
  or read (``eval/``, ``checkpoints/``, ``sft/``, ``final/``, ... at any depth) is refused by name.

Every refusal is a `RunDirError` (a `ConfigError`): one line naming the path, before anything is
written (sage-train and sage-eval exit 2 on it).
"""

from __future__ import annotations

import errno
import io
import os
import secrets
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from .config_rules import ConfigError

#: the folder W&B keeps its own files in (under a run's wandb/): its relative links are its own
WANDB_OWN = ("wandb", "wandb")


class RunDirError(ConfigError):
    """A path in a run (or output) directory that sage refuses to open: a link, a folder where a
    file belongs, a FIFO, a name too long for the filesystem."""


def refused(path: Path, error: OSError) -> RunDirError:
    """The one-line refusal of `path` for the `OSError` opening or making it raised."""
    why = {
        errno.ELOOP: "is a symbolic link (files here are never written through one); remove it",
        errno.EISDIR: "is a folder where a file belongs; remove it",
        errno.ENOTDIR: "lies under something that is not a folder",
        errno.ENAMETOOLONG: "has a name too long for the filesystem; choose a shorter one",
        errno.ENXIO: "is a FIFO or socket, not a regular file; remove it",
    }.get(error.errno, f"cannot be made or opened ({error.strerror or error})")
    return RunDirError(f"{path} {why}")


def links_in(folder: Path, names: Iterable[str]) -> list[Path]:
    """The symbolic links among ``folder / name`` for each of `names`, and under those that are
    folders, at any depth (a linked folder is reported, not entered). Links inside W&B's own
    folder (`WANDB_OWN`) are W&B's and are not reported."""
    folder, found = Path(folder), []
    for name in names:
        path = folder / name
        if path.is_symlink():
            found.append(path)
            continue
        if not path.is_dir():
            continue
        for root, subfolders, files in os.walk(path):
            if Path(root).relative_to(folder).parts[-2:] == WANDB_OWN:
                subfolders[:] = []
                continue
            found += [Path(root, entry) for entry in sorted(subfolders + files) if Path(root, entry).is_symlink()]
    return found


def refuse_links(folder: Path, names: Iterable[str], what: str) -> None:
    """`RunDirError` naming the first link `links_in` finds (and where it points), or a path that
    cannot be looked at (a name too long for the filesystem)."""
    try:
        found = links_in(folder, names)
    except OSError as error:
        raise refused(Path(error.filename or folder), error) from None
    if found:
        link = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise RunDirError(
            f"{what} {folder}: {link.relative_to(folder)} is a symbolic link (to {os.readlink(link)}){more}; "
            f"sage never writes or reads a run's files through links: replace it with the files themselves"
        )


def make_dir(path: Path) -> Path:
    """`path` made (with its parents) if absent; `RunDirError` when it is a link or cannot be made."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise refused(path, error) from None
    if path.is_symlink():
        raise refused(path, OSError(errno.ELOOP, "a link"))
    return path


def fresh_dir(path: Path) -> Path:
    """An empty folder at `path`, whatever was there (a link is removed, not followed)."""
    remove(path)
    Path(path).mkdir(parents=True)
    return Path(path)


def remove(path: Path, *, quiet: bool = False) -> None:
    """Delete the file, link or folder tree at `path` without following any link; nothing if absent.
    ``quiet``: an error (a read-only folder) is ignored."""
    path = Path(path)
    try:
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
    except OSError:
        if not quiet:
            raise


def _open_regular(path: Path, flags: int):
    """os.open with ``O_NOFOLLOW`` (and ``O_NONBLOCK``: a FIFO must not hang the open), the result a
    regular file; `RunDirError` otherwise."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EISDIR, errno.ENAMETOOLONG, errno.ENXIO, errno.ENOTDIR):
            raise refused(Path(path), error) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise refused(Path(path), OSError(errno.ENXIO, "not a regular file"))
    os.set_blocking(fd, True)
    return fd


def open_append(path: Path):
    """A text file object appending to `path` (created if absent), never through a link."""
    return os.fdopen(_open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a")


def open_lock(path: Path) -> int:
    """A read-write descriptor of the lock file `path` (created if absent), never through a link."""
    return _open_regular(path, os.O_RDWR | os.O_CREAT)


def write_file(path: Path, data: str | bytes, *, sync: bool = False) -> None:
    """`path` holds `data` whole, or what it held before: written to a new temporary file beside it
    (module docstring), fsynced with ``sync``, then renamed over `path`."""
    path = Path(path)
    for _ in range(100):
        staged = path.with_name(f".{path.name[:200]}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(staged, path)
    except BaseException:
        remove(staged, quiet=True)
        raise


def save_figure(fig, path: Path, **savefig) -> Path:
    """A matplotlib figure saved to `path` (its format from the suffix) by `write_file`."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix.lstrip(".") or "png", **savefig)
    write_file(Path(path), buffer.getvalue())
    return Path(path)
