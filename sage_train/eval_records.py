"""`sage-eval`'s resumable records: one line per finished (model, task, seed, problem) in
records.jsonl (and its completions in completions.jsonl), written at once, so a killed evaluation
loses at most the problem in progress and resumes from the file; the sampling settings are kept
beside them so that a resume cannot mix draws made with other settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

RECORDS_FILE = "records.jsonl"
COMPLETIONS_FILE = "completions.jsonl"


def read_records(out: Path) -> dict[tuple[str, str, int, str], dict]:
    """Finished problems of an earlier run in `out`, keyed by (model, task, seed, problem id).

    A kill can leave the last line half written: it is dropped (that problem is redone) and
    cut from the file so that new records start on a fresh line."""
    path = out / RECORDS_FILE
    if not path.is_file():
        return {}
    records, good_bytes = {}, 0
    with open(path, "rb") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number} is not a JSON record; remove the file to start afresh")
        if not line.endswith(b"\n"):
            break
        records[(record["model"], record["task"], record["seed"], record["problem_id"])] = record
        good_bytes += len(line)
    if good_bytes < path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return records


def check_sampling(out: Path, sampling: dict) -> None:
    """Refuse to resume into `out` with different sampling settings; record them on first use."""
    path = out / "sampling.json"
    if path.is_file():
        previous = json.loads(path.read_text())
        changed = {k: (previous.get(k), sampling[k]) for k in sampling if previous.get(k) != sampling[k]}
        if changed:
            details = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in changed.items())
            raise ValueError(
                f"--out {out} holds samples drawn with other settings ({details}); "
                "use another --out or the same settings"
            )
    else:
        path.write_text(json.dumps(sampling, indent=1) + "\n")


class RecordWriter:
    """Appends finished problems to records.jsonl (and completions.jsonl), flushed at once so
    that a killed run loses at most the problem in progress."""

    def __init__(self, out: Path, save_completions: bool):
        self.records = open(out / RECORDS_FILE, "a")
        self.completions = open(out / COMPLETIONS_FILE, "a") if save_completions else None

    def writer_for(self, model: str, task: str) -> Callable[[dict, list[str], list[float]], None]:
        """An `on_record` callback for `evaluate_engine` that tags records with model and task."""

        def write(record: dict, completions: list[str], scores: list[float]) -> None:
            keyed = {"model": model, "task": task} | record
            if self.completions is not None:  # first, so that a record implies its completions
                texts = keyed | {"completions": completions, "scores": scores}
                self.completions.write(json.dumps(texts) + "\n")
                self.completions.flush()
            self.records.write(json.dumps(keyed) + "\n")
            self.records.flush()

        return write

    def close(self) -> None:
        self.records.close()
        if self.completions is not None:
            self.completions.close()
