"""Ctrl-C to a real `sage-study` (issue 23 item 8): the run in flight stops at a checkpoint, no
queued run starts after the signal, and the same command then resumes the stopped run and
finishes the grid."""

import json
import os
import signal
import subprocess
import sys
import time

from sage_train.cli import study_main

STUDY = "import sys; from sage_train.cli import study_main; sys.exit(study_main())"


def test_sigint_stops_the_queue_and_a_rerun_finishes(tmp_path, capsys):
    out = tmp_path / "study"
    argv = ["--algorithms", "grpo,sage-branch", "--seeds", "0", "--steps", "40", "--eval-n", "2"]
    argv += ["--eval-problems", "3", "--jobs", "1", "--out", str(out), "--sft_steps=20", "--prompts_per_step=2"]
    argv += ["--group_size=2", "--micro_batch_size=4", "--task_options={digits: 1}", "--max_new_tokens=3"]
    argv += ["--save_every=5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    study = subprocess.Popen([sys.executable, "-c", STUDY, *argv], env=env, stdout=subprocess.PIPE, text=True)
    metrics = out / "runs" / "grpo-s0" / "metrics.jsonl"
    try:  # with one job, start-s0 runs first, then grpo-s0 while sage-branch-s0 waits in the queue
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert study.poll() is None, "the study ended before grpo-s0 trained"
            time.sleep(0.2)
        study.send_signal(signal.SIGINT)
        printed, _ = study.communicate(timeout=600)
    finally:
        if study.poll() is None:  # a failed check: stop the study as a user would, then make sure
            study.send_signal(signal.SIGTERM)
            study.wait(timeout=120)
    assert study.returncode == 130, printed
    assert "sage-branch-s0: not started" in printed
    assert not (out / "runs" / "sage-branch-s0").exists()  # the queued run never started
    summary = json.loads((out / "runs" / "grpo-s0" / "summary.json").read_text())
    assert summary["interrupted"] and 2 <= summary["steps_done"] < 40
    stopped_rows = metrics.read_text().splitlines()
    assert len(stopped_rows) == summary["steps_done"] and any((out / "runs" / "grpo-s0" / "checkpoints").iterdir())

    assert study_main(argv) == 0
    printed = capsys.readouterr().out
    assert all(f"{name}-s0: ok" in printed for name in ("start", "grpo", "sage-branch")), printed
    rows = metrics.read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == list(range(1, 41))
    assert rows[: len(stopped_rows)] == stopped_rows  # resumed: the steps before the signal were kept, not rerun
    report = json.loads((out / "study.json").read_text())
    assert all(report["counts"][arm]["0"]["n"] == 2 for arm in ("start", "grpo", "sage-branch"))
