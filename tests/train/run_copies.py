"""Runs as tests make and copy them: seconds-long runs' options (`TINY_RUN`, `QUICK_RUN`), a copy made the way
users make cheap ones (`link_copy`: ``cp -al``, every file a hard link to the original's), and a
snapshot of a folder's entries to compare before and after a command."""

import hashlib
import os
from pathlib import Path

#: a run that takes seconds: a 2-layer, 32-wide model on 1-digit addition
TINY_RUN = {
    "model": "tiny",
    "tiny_hidden_size": 32,
    "tiny_layers": 2,
    "tiny_heads": 2,
    "tiny_kv_heads": 1,
    "tiny_intermediate_size": 64,
    "task": "arithmetic",
    "task_options": {"digits": 1},
    "sft_steps": 0,
    "steps": 3,
    "prompts_per_step": 4,
    "group_size": 4,
    "micro_batch_size": 8,
    "max_new_tokens": 4,
    "eval_problems": 0,
    "progress": False,
    "plots": False,
    "report_to": [],
    "loss_backend": "auto",
    "cpu_threads": 1,
}


#: a run of a few seconds on a CPU: a 1-layer, 32-wide model on 1-digit addition, checkpointed at
#: every step, its completions logged
QUICK_RUN = {
    **TINY_RUN,
    "tiny_layers": 1,
    "steps": 2,
    "prompts_per_step": 2,
    "group_size": 2,
    "micro_batch_size": 4,
    "save_every": 1,
    "log_completions": 2,
}


def write_entries(run: Path, names) -> Path:
    """`run` holding each entry of `names` (a path inside it) as a file of its own content: what a
    finished run leaves, for a command to keep or refuse to touch."""
    for name in names:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(f"{name} of the finished run\n")
    return run


def link_copy(source: Path, target: Path) -> Path:
    """`target` as ``cp -al source target`` makes it: the same folders, each file a hard link to
    the one in `source` (a symbolic link is copied as a link)."""
    for root, folders, files in os.walk(source):
        here = Path(target, Path(root).relative_to(source))
        here.mkdir(parents=True, exist_ok=True)
        for name in folders:
            if Path(root, name).is_symlink():
                os.symlink(os.readlink(Path(root, name)), here / name)
        for name in files:
            os.link(Path(root, name), here / name, follow_symlinks=False)
    return Path(target)


def snapshot(folder: Path) -> dict:
    """Every entry under `folder` (links as links, never followed) with its content hash."""
    entries = {}
    for root, folders, files in os.walk(folder):
        for name in folders + files:
            path = Path(root, name)
            key = str(path.relative_to(folder))
            if path.is_symlink():
                entries[key] = f"-> {os.readlink(path)}"
            elif path.is_file():
                entries[key] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                entries[key] = "dir"
    return entries
