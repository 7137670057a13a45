"""Writing inside a folder that someone else may have made: a run directory, sage-eval's --out, a
study's --out. Such a folder is data: nothing in it may make sage write outside it, so no file in it
is ever opened through a symbolic link. This module is the one home of every write there:

- `write_file`: a whole file is written to a new temporary file beside it (made as mkstemp makes
  one: a random name, ``O_CREAT | O_EXCL | O_NOFOLLOW``, but with an ordinary file's permissions),
  then renamed over the name: a link there is replaced, never followed (`save_figure` for plots);
- `open_append`, `open_lock`: logs that grow and lock files are opened with ``O_NOFOLLOW``, and
  must be regular files (a link, a folder or a FIFO there is refused: `RunDirError`). A file with
  other hard links (``cp -al``, the cheap copy of a run, or a link planted by a sender) is first
  replaced by a copy of its own (`own_copy`), so that what sage appends never reaches the other names;
- `make_dir` makes a folder and refuses a link in its place; `fresh_dir` makes a staging folder
  anew, so that what a library saves into it (DeepSpeed, transformers) lands inside it;
- `write_atomically` (a file) and `folder_written_atomically` (a folder: a model, a checkpoint's staging
  via `replace_folder` and `fsync_path`) leave the old copy or the new one whole, never a half-written one;
- `remove` deletes a file, link or tree, never following a link (a link goes, its target stays);
- `refuse_links`: before a command touches such a folder, any link among the entries it will write
  or read (``eval/``, ``checkpoints/``, ``sft/``, ``final/``, ... at any depth) is refused by name.

Reading such a folder (or a model folder) is guarded too: `read_bytes`, `read_text` and `parse_json`
check that a file is a regular one before opening it (a FIFO would block the open, /dev/zero never
ends) and read it with a size bound; JSON nested too deeply for the parser is a `ValueError`.

Every refusal is a `RunDirError` (a `ConfigError`): one line naming the path, before anything is
written (sage-train and sage-eval exit 2 on it).
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from .errors import NotAFileError, RunDirError, RunError

#: the folder W&B keeps its own files in (under a run's wandb/): its relative links are its own
WANDB_OWN = ("wandb", "wandb")
#: the suffix of a staging folder: a save in progress (or killed)
PARTIAL = ".partial"
#: free bytes under which a failed write is read as a full disk (torch reports ENOSPC as an iostream error)
FULL_DISK_BYTES = 1 << 20


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
    """A text file object appending to `path` (created if absent), never through a link, nor into a
    file that has other hard links (`own_copy`)."""
    fd = _open_regular(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    if os.fstat(fd).st_nlink > 1:
        try:
            fd = own_copy(path, fd, keep_data=True)
        except BaseException:
            os.close(fd)
            raise
    return os.fdopen(fd, "a")


def open_lock(path: Path) -> int:
    """A read-write descriptor of the lock file `path` (created if absent), never through a link.
    The caller locks it, then replaces it by `own_copy` if it has other hard links."""
    return _open_regular(path, os.O_RDWR | os.O_CREAT)


def own_copy(path: Path, fd: int, *, keep_data: bool) -> int:
    """Replace the file `path` (open as `fd`, which has other hard links) by a new file of its own,
    renamed over the name, and return a read-write descriptor of the new file (`fd` is closed). With
    `keep_data` the new file holds a copy of the old one's bytes and appends (a log); without, it is
    empty and holds an exclusive ``flock`` before it takes the name, so a lock file changes hands
    without a moment unlocked (call it while holding the old file's lock)."""
    path = Path(path)
    staged, new = _new_temporary(path, os.O_RDWR | (os.O_APPEND if keep_data else 0))
    try:
        os.fchmod(new, stat.S_IMODE(os.fstat(fd).st_mode))
        if keep_data:
            size, offset = os.fstat(fd).st_size, 0
            while offset < size:  # the size read once: a file that keeps growing cannot stall us
                chunk = os.pread(fd, min(1 << 20, size - offset), offset)
                if not chunk:
                    break
                offset += len(chunk)
                while chunk:  # os.write may write a part
                    chunk = chunk[os.write(new, chunk) :]
        else:
            fcntl.flock(new, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(staged, path)
    except BaseException:
        os.close(new)
        remove(staged, quiet=True)
        raise
    os.close(fd)
    return new


def _new_temporary(path: Path, flags: int) -> tuple[Path, int]:
    """A new file beside `path` (module docstring: a random name, never through a link) and its
    descriptor, opened with `flags`."""
    for _ in range(100):
        staged = path.with_name(f".{path.name[:200]}.{secrets.token_hex(4)}.tmp")
        try:
            return staged, os.open(staged, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))


def write_file(path: Path, data: str | bytes, *, sync: bool = False) -> None:
    """`path` holds `data` whole, or what it held before: written to a new temporary file beside it
    (module docstring), fsynced with ``sync``, then renamed over `path`."""
    path = Path(path)
    staged, fd = _new_temporary(path, os.O_WRONLY)
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


def read_bytes(path: Path, limit: int) -> bytes:
    """The bytes of the regular file `path` (a link to one is followed), at most `limit` of them.
    `NotAFileError` naming it when it is anything else (checked before it is opened: opening a FIFO
    blocks) or larger; `FileNotFoundError` when it is absent."""
    path = check_regular(Path(path))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:  # what was opened is the file checked (not a FIFO swapped in since)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotAFileError(f"{path} is not a regular file; remove it")
        if os.fstat(fd).st_size > limit:
            raise NotAFileError(f"{path} has {os.fstat(fd).st_size} bytes, more than a file of its kind may ({limit})")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit)
    finally:
        os.close(fd)


def read_text(path: Path, limit: int) -> str:
    """`read_bytes` of `path` as UTF-8 text (`ValueError` naming it otherwise)."""
    data = read_bytes(path, limit)
    try:
        return data.decode()
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text ({error})") from None


def parse_json(text: str | bytes, where: Path | str):
    """``json.loads(text)``; its errors, and nesting too deep for the parser (a RecursionError
    otherwise), are a `ValueError` naming `where`."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{where} nests JSON arrays or objects too deeply to be read") from None
    except ValueError as error:
        raise ValueError(f"{where} is not valid JSON ({error})") from None


def read_json(path: Path, limit: int):
    """The JSON value in the file `path` (`read_bytes`, `parse_json`)."""
    return parse_json(read_bytes(path, limit), path)


def check_regular(path: Path) -> Path:
    """`path`, once its ``stat`` (following links, never opening it) says it is a regular file;
    `NotAFileError` naming it and what it is otherwise, `FileNotFoundError` when it is absent."""
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        if not os.path.islink(path):
            raise
        regular = False  # a dangling link: reported as one, not as an absent file
    if not regular:
        raise NotAFileError(f"{path} is not a regular file ({_kind(path)}); sage reads only files there: remove it")
    return Path(path)


def _kind(path: Path) -> str:
    """What `path` is, in words, for a refusal."""
    if os.path.islink(path) and not os.path.exists(path):
        return f"a dangling link to {os.readlink(path)}"
    mode = os.stat(path).st_mode
    kind = next(
        (
            word
            for test, word in (
                (stat.S_ISFIFO, "a FIFO"),
                (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"),
                (stat.S_ISSOCK, "a socket"),
                (stat.S_ISDIR, "a folder"),
            )
            if test(mode)
        ),
        "not a file",
    )
    return f"{kind}, through a link to {os.readlink(path)}" if os.path.islink(path) else kind


def save_figure(fig, path: Path, **savefig) -> Path:
    """A matplotlib figure saved to `path` (its format from the suffix) by `write_file`."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix.lstrip(".") or "png", **savefig)
    write_file(Path(path), buffer.getvalue())
    return Path(path)


def write_atomically(path: Path, text: str) -> None:
    """`path` holds `text` whole, or what it held before: staged beside it, fsynced, renamed over it.
    For the files a resume or a study reads back (eval_before.json, summary.json). `RunError` when
    it cannot be written (a full disk, a read-only folder), naming which."""
    try:
        write_file(path, text, sync=True)
        fsync_path(path.parent)
    except OSError as error:
        raise RunError(f"{path} could not be written: {why_not_written(error, path)}") from None


@contextmanager
def folder_written_atomically(folder: Path) -> Iterator[Path]:
    """Yields a staging folder to write `folder`'s files into; when the block ends without an error
    they are fsynced and the staging folder replaces `folder`. A kill or an error leaves the
    previous `folder` (or none), never a half-written one that loads as a model; a write that
    fails (a full disk, a read-only folder) raises `RunError` naming why."""
    staged = folder.with_name(f".{folder.name}{PARTIAL}")
    try:
        fresh_dir(staged)  # whatever a save killed earlier left (or a link put there)
        yield staged
        for path in staged.rglob("*"):
            fsync_path(path)
        fsync_path(staged)
        replace_folder(folder, staged)
        fsync_path(folder.parent)
    except (OSError, RuntimeError, SafetensorError) as error:  # torch and safetensors report IO errors so
        remove(staged, quiet=True)
        if isinstance(error, RunError):
            raise
        raise RunError(f"{folder} could not be written: {why_not_written(error, folder)}") from None


def replace_folder(folder: Path, staged: Path) -> None:
    """Rename the complete `staged` folder to `folder`, moving an existing `folder` aside first and
    deleting it after: at every moment `folder` is the old copy, absent, or the new one."""
    if os.path.lexists(folder):
        aside = staged.with_name(f"replaced-{staged.name}")
        remove(aside, quiet=True)
        folder.rename(aside)
        staged.rename(folder)
        remove(aside, quiet=True)
    else:
        staged.rename(folder)


def fsync_path(path: Path) -> None:
    """fsync the file or folder `path` (never through a link): what was written or renamed there survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def full_disk(error: BaseException, path: Path) -> int | None:
    """The free bytes where `path` lies when `error` reads as a full disk (torch reports ENOSPC as an
    iostream error, hence the free space too), else None."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    full = getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or free < FULL_DISK_BYTES
    return free if full else None


def why_not_written(error: BaseException, path: Path) -> str:
    """Why `path` could not be written, in words, and what to do: a full disk, a read-only folder, or
    the error itself."""
    free = full_disk(error, path)
    if free is not None:
        why = f"no space left on device ({free} bytes free)"
    elif getattr(error, "errno", None) in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = f"{path.parent} is not writable"
    else:
        why = " ".join(str(error).split()) or type(error).__name__
    return f"{why}; make room or make it writable and run the command again (sage-train with --resume)"
