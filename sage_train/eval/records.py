"""`sage-eval`'s resumable records: one line per finished (model, task, seed, problem) in
records.jsonl (and its completions in completions.jsonl), written at once, so a killed evaluation
loses at most the problem in progress and resumes from the file. A resume cannot mix draws made
otherwise: the sampling settings are kept beside them (sampling.json), and each record names the
fingerprint of the weights that drew it (`models.files.fingerprint`), so the records of a model that
has since been retrained or replaced are refused, not reused."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path

from ..safe_files import open_append, read_bytes, read_json, write_file

RECORDS_FILE = "records.jsonl"
COMPLETIONS_FILE = "completions.jsonl"
#: the most bytes of records.jsonl read back (a record is a few hundred bytes) and of sampling.json
RECORDS_MAX, SAMPLING_MAX = 1 << 30, 1 << 20


def read_records(out: Path) -> dict[tuple[str, str, int, str], dict]:
    """Finished problems of an earlier run in `out`, keyed by (model, task, seed, problem id).

    A kill can leave the last line half written: it is dropped (that problem is redone) and
    cut from the file so that new records start on a fresh line."""
    path = out / RECORDS_FILE
    if not os.path.lexists(path):
        return {}
    records, good_bytes = {}, 0
    lines = io.BytesIO(read_bytes(path, RECORDS_MAX)).readlines()  # a FIFO or a device is refused
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested beyond the parser
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number} is not a JSON record; remove the file to start afresh")
        if not line.endswith(b"\n"):
            break
        if not isinstance(record, dict) or not {"model", "task", "seed", "problem_id", "n", "c"} <= set(record):
            raise ValueError(f"{path}:{number} is not a sage-eval record; remove the file to start afresh")
        records[(record["model"], record["task"], record["seed"], record["problem_id"])] = record
        good_bytes += len(line)
    if good_bytes < path.stat().st_size:
        with open_append(path) as f:  # never through a link
            f.truncate(good_bytes)
    return records


def check_fingerprints(out: Path, records: dict, fingerprints: dict[str, str]) -> None:
    """Refuse records of a model (by label) drawn from other weights than `fingerprints` names."""
    for (label, *_), record in records.items():
        drawn_by = record.get("fingerprint")
        if label in fingerprints and drawn_by != fingerprints[label]:
            was = f"weights {drawn_by[:12]}" if drawn_by else "weights an older sage-eval did not record"
            raise ValueError(
                f"--out {out} holds samples of model {label!r} drawn from other {was}, not the ones it has "
                f"now ({fingerprints[label][:12]}): was it retrained? Use another --out, or remove {out} to "
                f"evaluate it afresh"
            )


def check_sampling(out: Path, sampling: dict) -> None:
    """Refuse to resume into `out` with different sampling settings; record them on first use."""
    path = out / "sampling.json"
    if os.path.lexists(path):
        previous = read_json(path, SAMPLING_MAX)
        changed = {k: (previous.get(k), sampling[k]) for k in sampling if previous.get(k) != sampling[k]}
        if changed:
            details = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in changed.items())
            raise ValueError(
                f"--out {out} holds samples drawn with other settings ({details}); "
                "use another --out or the same settings"
            )
    else:
        write_file(path, json.dumps(sampling, indent=1) + "\n")


class RecordWriter:
    """Appends finished problems to records.jsonl (and completions.jsonl), flushed at once so
    that a killed run loses at most the problem in progress."""

    def __init__(self, out: Path, save_completions: bool, fingerprints: dict[str, str]):
        self.records = open_append(out / RECORDS_FILE)
        self.completions = open_append(out / COMPLETIONS_FILE) if save_completions else None
        self.fingerprints = fingerprints

    def writer_for(self, model: str, task: str) -> Callable[[dict, list[str], list[float]], None]:
        """An `on_record` callback for `evaluate_engine` that tags records with model and task."""

        def write(record: dict, completions: list[str], scores: list[float]) -> None:
            keyed = {"model": model, "fingerprint": self.fingerprints[model], "task": task} | record
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
