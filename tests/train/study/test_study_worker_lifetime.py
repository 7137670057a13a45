"""A study's workers die with it: kill -9 of a real `sage-study` while its worker trains leaves no
worker running (one would otherwise go on training and evaluating into --out after the study's
lock is gone, ignoring SIGTERM between runs). And an empty --algorithms or --seeds is refused, not
read as the defaults."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sage_train.study.design import StudyError, parse_study

STUDY = "import sys; from sage_train.cli import study_main; sys.exit(study_main())"
REPO = Path(__file__).resolve().parents[3]


def children(pid: int) -> set[int]:
    """The processes `pid` started (its workers and multiprocessing's resource tracker)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(child) for child in (task / "children").read_text().split()}
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (an orphan may wait for its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
def test_kill_9_of_the_study_takes_its_worker_with_it(tmp_path):
    out = tmp_path / "study"
    argv = ["--algorithms", "grpo", "--seeds", "0", "--steps", "2", "--jobs", "1", "--out", str(out)]
    argv += ["--sft_steps=100000", "--task_options={digits: 1}"]  # the worker is in its warm start for long
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    study = subprocess.Popen([sys.executable, "-c", STUDY, *argv], env=env, stdout=subprocess.DEVNULL)
    lock = out / "runs" / "start-s0" / "run.lock"
    worker, started = None, set()
    try:
        deadline = time.time() + 600  # a first build of the native CPU operator may come first
        while worker is None and time.time() < deadline:
            assert study.poll() is None, "the study ended before its worker started training"
            started |= children(study.pid)
            try:
                worker = json.loads(lock.read_text())["pid"]
            except (FileNotFoundError, ValueError, KeyError):
                time.sleep(0.2)
        assert worker is not None and worker != study.pid and running(worker)
        started |= children(study.pid)
        assert worker in started
        study.kill()
        study.wait()
        deadline = time.time() + 60
        while running(worker) and time.time() < deadline:
            time.sleep(0.2)
        assert not running(worker), "the worker outlived its study"
    finally:
        if study.poll() is None:
            study.kill()
            study.wait()
        for pid in started | {worker} - {None}:  # what a failed check leaves running
            if running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("arg", ["--algorithms", "--seeds"])
def test_an_empty_list_is_refused_not_read_as_the_default(tmp_path, arg):
    argv = ["--algorithms", "grpo", "--seeds", "0", "--out", str(tmp_path / "out")]
    argv[argv.index(arg) + 1] = ""
    with pytest.raises(StudyError, match=arg.lstrip("-") if arg == "--algorithms" else "seeds"):
        parse_study(argv)
    assert not (tmp_path / "out").exists()
