"""Runs that cannot lose data, tried as a careful user and a faulty machine would: a typo or a fresh
run over an existing run, two runs on one directory, kill -9 inside the checkpoint window, damaged
checkpoints, a half-written metrics line, a full disk, non-finite steps, and the loggers across a
resume. Each fault ends with a clear message, the previous run intact, and a resume that reproduces
the uninterrupted run's metrics.

The runs are real (tiny Qwen2, DeepSpeed, in-process or as `python -m sage_train` subprocesses);
one uninterrupted run and one interrupted after step 4 are shared by the module's tests."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from run_copies import TINY_RUN

from sage_train import checkpoint, report
from sage_train.cli import train_main
from sage_train.config import ConfigError, build, resolve
from sage_train.distributed import RunError
from sage_train.run import train
from sage_train.run_dir import RunLock
from sage_train.run_files import RUN_FILES
from sage_train.safe_files import folder_written_atomically, write_atomically

REPO = Path(__file__).resolve().parents[2]
#: the shared runs: 6 steps, checkpoints every 2 (all kept)
OPTIONS = {"steps": 6, "save_every": 2, "keep_checkpoints": 0, "lr": 3e-3}


def config(output: Path, name: str, **overrides):
    return resolve(build({**TINY_RUN, **OPTIONS, "output_dir": str(output), "name": name, **overrides}))


def metrics(run_dir: Path) -> list[dict]:
    rows = report.read_metrics(Path(run_dir) / "metrics.jsonl")
    return [report.without_timing(row) for row in rows]


def assert_same_metrics(got: list[dict], expected: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for a, b in zip(got, expected):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)


def snapshot(folder: Path) -> dict:
    """Every file under `folder` with its content hash: what 'left intact' means."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file()
    }


def write_yaml(path: Path, values: dict) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def sage_train_process(args: list, env_extra: dict = None, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    env.pop("RANK", None)  # a world of its own, not the test process's
    return subprocess.Popen([sys.executable, "-m", "sage_train", *args], env=env, cwd=REPO, **popen)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, distributed):
    """The uninterrupted 6-step run's metrics, and a run of the same config stopped after step 4
    (checkpoints step2, step4) that each test copies and damages."""
    root = tmp_path_factory.mktemp("safety")
    whole = config(root, "whole")
    train(whole)

    def stop_after_4(step, row):
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    stopped = config(root, "stopped")
    assert train(stopped, on_step=stop_after_4)["steps_done"] == 4
    yaml_file = write_yaml(root / "tiny.yaml", {**TINY_RUN, **OPTIONS})
    return SimpleNamespace(root=root, whole=metrics(whole.run_dir), stopped=stopped.run_dir, yaml=yaml_file)


def copy_of_stopped(runs, tmp_path) -> Path:
    """A copy of the stopped run as tmp_path/stopped (same name: the config must match to resume)."""
    shutil.copytree(runs.stopped, tmp_path / "stopped")
    return tmp_path / "stopped"


def resume(output: Path, name: str = "stopped", **overrides):
    return train(config(output, name, resume=True, **overrides))


# --- bad input over an existing run: exit 2, one line naming the key, nothing touched -----------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model=/no/such/model"], ["'model'", "no directory '/no/such/model'"]),
        (["--task=bogus"], ["'task'", "bogus", "arithmetic"]),
        (["--prompts_per_step=7"], ["prompts_per_step", "micro_batch_size"]),
        (["--train_problems=3"], ["train_problems", "3 problems"]),
        (["--beta=-1"], ["'beta'", ">= 0"]),
        (["--lr=nan"], ["'lr'", "finite"]),
        (["--lr=.inf"], ["'lr'", "finite"]),
        ([], ["holds a previous run", "--resume", "--overwrite"]),  # a fresh run over an existing one
        (["--resume", "--overwrite"], ["'overwrite'", "resume"]),
    ],
)
def test_bad_input_exits_2_with_one_line_and_leaves_the_previous_run(runs, tmp_path, capsys, argv, words):
    run_dir = copy_of_stopped(runs, tmp_path)
    before = snapshot(run_dir)
    status = train_main(["--config", str(runs.yaml), f"--output_dir={tmp_path}", "--name=stopped", *argv])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sage-train:")]
    assert status == 2 and len(lines) == 1, lines
    for word in words:
        assert word in lines[0]
    assert "digits" not in lines[0]  # --task=bogus is about the name, not about the arithmetic options
    assert snapshot(run_dir) == before


def test_overwrite_replaces_the_previous_run(runs, tmp_path, capsys):
    run_dir = copy_of_stopped(runs, tmp_path)
    status = train_main(["--config", str(runs.yaml), f"--output_dir={tmp_path}", "--name=stopped", "--overwrite"])
    assert status == 0 and "--overwrite: starting" in capsys.readouterr().out
    assert_same_metrics(metrics(run_dir), runs.whole)
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".previous_run")]  # deleted after step 1
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest",
        "step000002",
        "step000004",
        "step000006",
    ]


# --- damaged checkpoints: fall back to the newest complete one, say what was skipped ---------------------


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGES = {
    # name: (damage to the copy of the stopped run, the checkpoint resumed from, words of the warning)
    "truncated model file": (
        lambda ck: truncate(ck / "step000004" / "mp_rank_00_model_states.pt"),
        2,
        ["step000004", "mp_rank_00_model_states.pt"],
    ),
    "0-byte rank0.pt": (lambda ck: (ck / "step000004" / "rank0.pt").write_bytes(b""), 2, ["step000004", "rank0.pt"]),
    "no manifest (a copy cut short)": (lambda ck: (ck / "step000004" / "manifest.json").unlink(), 2, ["step000004"]),
    "empty latest": (lambda ck: (ck / "latest").write_text(""), 4, ["'latest' (empty"]),
    "latest naming a missing step": (lambda ck: (ck / "latest").write_text("step000008"), 4, ["step000008"]),
    "latest missing": (lambda ck: (ck / "latest").unlink(), 4, []),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_resume_falls_back_to_the_newest_complete_checkpoint(runs, tmp_path, capsys, damage):
    run_dir = copy_of_stopped(runs, tmp_path)
    damage_fn, resumed_from, words = DAMAGES[damage]
    damage_fn(run_dir / "checkpoints")
    intact = snapshot(run_dir / "checkpoints" / "step000002")
    resume(tmp_path)
    out = capsys.readouterr().out
    if words:
        warning = next(line for line in out.splitlines() if "resuming from" in line)
        assert f"resuming from step{resumed_from:06d}" in warning
        for word in words:
            assert word in warning
    rows = metrics(run_dir)
    assert_same_metrics(rows, runs.whole)
    if resumed_from == 4:  # steps 1-4 were not recomputed: the stopped run's rows are kept as they were
        assert rows[:4] == metrics(runs.stopped)
    assert snapshot(run_dir / "checkpoints" / "step000002") == intact
    assert [checkpoint.verify(run_dir / "checkpoints" / f"step00000{s}", 1) for s in (2, 4, 6)] == [None] * 3


def test_resume_after_a_kill_inside_the_first_save_starts_at_step_1(runs, tmp_path, capsys):
    """What a kill -9 inside the first checkpoint's window leaves: a half-written staging folder and
    no `latest`. Nothing was complete, so the resume starts over and keeps nothing of the killed run's."""
    run_dir = copy_of_stopped(runs, tmp_path)
    checkpoints = run_dir / "checkpoints"
    for name in ("step000004", "latest"):
        shutil.rmtree(checkpoints / name) if (checkpoints / name).is_dir() else (checkpoints / name).unlink()
    (checkpoints / "step000002").rename(tmp_path / "aside")
    (checkpoints / checkpoint.PARTIAL).mkdir()
    (tmp_path / "aside").rename(checkpoints / checkpoint.PARTIAL / "step000002")
    truncate(checkpoints / checkpoint.PARTIAL / "step000002" / "mp_rank_00_model_states.pt")
    resume(tmp_path)
    line = next(line for line in capsys.readouterr().out.splitlines() if "starts at step 1" in line)
    assert ".partial/step000002 (a save that did not finish)" in line
    assert_same_metrics(metrics(run_dir), runs.whole)
    assert not (checkpoints / checkpoint.PARTIAL).exists()


def test_no_usable_checkpoint_is_a_clear_error_and_deletes_nothing(runs, tmp_path, capsys):
    run_dir = copy_of_stopped(runs, tmp_path)
    truncate(run_dir / "checkpoints" / "step000004" / "mp_rank_00_model_states.pt")
    (run_dir / "checkpoints" / "step000002" / "rank0.pt").write_bytes(b"")
    before = snapshot(run_dir)
    status = train_main(["--config", str(runs.yaml), f"--output_dir={tmp_path}", "--name=stopped", "--resume"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert status == 2 and "no usable checkpoint" in line and "step000002" in line and "step000004" in line
    assert "--overwrite" in line
    assert snapshot(run_dir) == before


def test_checkpoint_that_fails_to_load_is_skipped(runs, tmp_path, capsys):
    """A file damaged in place (same size, bytes garbled): the manifest cannot see it, loading can."""
    run_dir = copy_of_stopped(runs, tmp_path)
    model_file = run_dir / "checkpoints" / "step000004" / "mp_rank_00_model_states.pt"
    model_file.write_bytes(b"\0" * model_file.stat().st_size)
    resume(tmp_path)
    warning = next(line for line in capsys.readouterr().out.splitlines() if "resuming from" in line)
    assert "resuming from step000002" in warning and "step000004 (loading failed" in warning
    assert_same_metrics(metrics(run_dir), runs.whole)


# --- the metrics log -----------------------------------------------------------------------------------


def test_half_written_metrics_line_is_dropped_on_resume(runs, tmp_path, capsys):
    run_dir = copy_of_stopped(runs, tmp_path)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "reward": 0.')  # what a kill -9 inside a write leaves
    resume(tmp_path)
    assert "dropped the half-written last line" in capsys.readouterr().out
    assert_same_metrics(metrics(run_dir), runs.whole)


def test_garbled_metrics_line_inside_the_file_is_an_error(runs, tmp_path):
    run_dir = copy_of_stopped(runs, tmp_path)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:20]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(RunError, match="line 2 is not JSON"):
        resume(tmp_path)


# --- the lock ------------------------------------------------------------------------------------------


def test_lock_refuses_a_second_holder_and_reports_a_stale_one(tmp_path, capsys):
    with RunLock(tmp_path, rank=0):
        holder = json.loads((tmp_path / RUN_FILES.lock).read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(ConfigError, match=rf"in use by pid {os.getpid()} on "):
            RunLock(tmp_path, rank=0).__enter__()
    assert not (tmp_path / RUN_FILES.lock).exists()  # released on exit
    (tmp_path / RUN_FILES.lock).write_text(
        json.dumps({"pid": 999999, "host": "gone", "started": "then", "command": "x"})
    )
    with RunLock(tmp_path, rank=0):
        assert "left by pid 999999 on gone" in capsys.readouterr().out
    assert not (tmp_path / RUN_FILES.lock).exists()


def kill_inside_a_save(process: subprocess.Popen, run_dir: Path) -> bool:
    """Poll `process` (saving a checkpoint at every step) and kill it (-9) while a checkpoint after the
    first is half-written: stopped (SIGSTOP) as soon as one appears, killed if it is still there.
    False when the run ended without the poll catching one (a save takes milliseconds)."""
    partial, first = run_dir / "checkpoints" / checkpoint.PARTIAL, run_dir / "checkpoints" / "step000001"

    def staged() -> list:  # the staging folder comes and goes with each save, also while it is listed
        try:
            return [p for p in partial.glob("step*") if p.is_dir()]
        except FileNotFoundError:
            return []

    while process.poll() is None:
        if first.is_dir() and staged():
            process.send_signal(signal.SIGSTOP)
            if staged():  # still mid-save: kill it there
                process.kill()
                process.wait()
                return True
            process.send_signal(signal.SIGCONT)
        time.sleep(0.0002)
    return False


@pytest.mark.slow
def test_second_run_and_kill_9_in_the_checkpoint_window(runs, tmp_path, capsys):
    """A subprocess run saving at every step: a second run on its directory (while the first is
    held stopped) exits 2 naming it; the first is then killed (-9) while a checkpoint is half-written;
    the resume reports the stale lock and the unfinished save, and reproduces the uninterrupted run's
    metrics. The window is milliseconds wide: up to three runs are tried to land a kill inside it."""
    for attempt in range(3):
        name = f"killed{attempt}"
        run_dir = tmp_path / name
        args = ["--config", str(runs.yaml), f"--output_dir={tmp_path}", f"--name={name}", "--save_every=1"]
        process = sage_train_process(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            if attempt == 0:
                lock, deadline = run_dir / RUN_FILES.lock, time.time() + 300
                while not (lock.is_file() and lock.read_text()) and time.time() < deadline:
                    time.sleep(0.05)
                process.send_signal(signal.SIGSTOP)  # held, so that it is still running during the second
                assert train_main(args) == 2
                assert f"in use by pid {process.pid} " in capsys.readouterr().out
                process.send_signal(signal.SIGCONT)
            killed = kill_inside_a_save(process, run_dir)
        finally:
            process.kill()
            process.wait()
        if killed:
            break
    else:
        pytest.fail("three runs saved their checkpoints without the poll catching one half-written")
    usable, skipped = checkpoint.find(run_dir, 1)
    assert usable and any("did not finish" in s for s in skipped)
    assert (run_dir / "checkpoints" / "latest").read_text() == usable[0].name
    resume(tmp_path, name, save_every=1)
    out = capsys.readouterr().out
    assert f"left by pid {process.pid} " in out
    assert_same_metrics(metrics(run_dir), runs.whole)


# --- a full disk ---------------------------------------------------------------------------------------


def can_mount_tmpfs() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs unshare -rm (a user namespace) to mount a small tmpfs")
def test_full_disk_says_so_and_keeps_the_previous_checkpoint(runs, tmp_path):
    """The run writes to a 512 KiB tmpfs (a checkpoint is ~140 KiB): it fails at a checkpoint with "no
    space left on device", exit 1, `latest` on the previous complete checkpoint; that copy resumes."""
    mount, kept = tmp_path / "small", tmp_path / "kept"
    mount.mkdir()
    kept.mkdir()
    script = (
        f"mount -t tmpfs -o size=512k tmpfs {mount} && "
        f"{sys.executable} -m sage_train --config {runs.yaml} --output_dir={mount} --name=full --save_every=1; "
        f"status=$?; cp -a {mount}/full {kept}/; exit $status"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RANK", None)
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    message = [line for line in done.stdout.splitlines() if line.startswith("sage-train:")][-1]
    assert "no space left on device" in message and "Traceback" not in done.stderr
    run_dir = kept / "full"
    usable, skipped = checkpoint.find(run_dir, 1)
    assert usable and not skipped  # nothing half-written was left behind
    assert (run_dir / "checkpoints" / "latest").read_text() == usable[0].name
    assert 1 <= checkpoint.step_of(usable[0]) < 6
    resume(kept, "full", save_every=1)
    assert_same_metrics(metrics(run_dir), runs.whole)


def test_a_failed_model_save_leaves_the_previous_folder_whole_and_a_finished_one_replaces_it(tmp_path):
    """final/ and sft/ are written through `folder_written_atomically`: a save that dies half-way (here a
    write that raises after the first file) never leaves a folder that loads as a model."""
    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text("old")
    with pytest.raises(RunError, match="disk gone"):
        with folder_written_atomically(final) as staged:
            (staged / "config.json").write_text("new")
            raise OSError("disk gone")
    assert [p.name for p in final.iterdir()] == ["config.json"] and (final / "config.json").read_text() == "old"
    with folder_written_atomically(final) as staged:
        (staged / "config.json").write_text("new")
        (staged / "model.safetensors").write_bytes(b"weights")
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "model.safetensors"]
    assert (final / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no staging or replaced copy left
    summary = tmp_path / "summary.json"
    write_atomically(summary, '{"steps_done": 1}\n')
    write_atomically(summary, '{"steps_done": 2}\n')
    assert json.loads(summary.read_text()) == {"steps_done": 2} and sorted(p.name for p in tmp_path.iterdir()) == [
        "final",
        "summary.json",
    ]


# --- non-finite steps ----------------------------------------------------------------------------------


def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path, capsys, distributed):
    """beta = 3e38 (finite, accepted): from step 1 the KL gradient overflows float32, so every
    optimizer step is skipped; after max_nonfinite_steps in a row the run stops, exit 1, with the
    weights it started from in its checkpoint."""
    from sage_train.models.loading import load_model_and_tokenizer

    yaml_file = write_yaml(tmp_path / "tiny.yaml", {**TINY_RUN, **OPTIONS})
    argv = [
        "--config",
        str(yaml_file),
        f"--output_dir={tmp_path}",
        "--name=nan",
        "--beta=3e38",
        "--save_every=1",
        "--max_nonfinite_steps=2",
    ]
    assert train_main(argv) == 1
    out = capsys.readouterr().out
    assert "step 1: optimizer step skipped (non-finite gradient norm)" in out
    assert "sage-train: steps 1..2 all had a non-finite loss or gradient" in out
    rows = report.read_metrics(tmp_path / "nan" / "metrics.jsonl")
    assert [(r["step"], r["nonfinite/skipped_steps"]) for r in rows] == [(1, 1.0), (2, 1.0)]
    saved = torch.load(
        tmp_path / "nan" / "checkpoints" / "step000001" / "mp_rank_00_model_states.pt", weights_only=False
    )["module"]
    initial, _ = load_model_and_tokenizer(config(tmp_path, "nan"))
    for name, value in initial.state_dict().items():
        torch.testing.assert_close(saved[f"lm.{name}"], value, rtol=0, atol=0)
    assert not (tmp_path / "nan" / RUN_FILES.lock).exists()


# --- loggers -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_loggers_write_locally_and_a_resume_after_kill_9_duplicates_no_step(runs, tmp_path, monkeypatch):
    """TensorBoard, W&B (offline) and trackio: a run killed (-9) after logging step 3 past its step-2
    checkpoint, then resumed, has steps 1..6 once each in every logger."""
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "TRACKIO_DIR": str(tmp_path / "trackio")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    loggers = '["tensorboard","wandb","trackio"]'
    args = ["--config", str(runs.yaml), f"--output_dir={tmp_path}", "--name=logged", f"--report_to={loggers}"]
    process = sage_train_process(args, env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = tmp_path / "logged" / "metrics.jsonl"
    try:
        deadline = time.time() + 300
        while process.poll() is None and time.time() < deadline:
            if log.is_file() and log.read_text().count("\n") >= 3:
                time.sleep(0.5)  # step 4 runs; the loggers flush step 3
                process.kill()
                break
            time.sleep(0.01)
    finally:
        process.kill()
        process.wait()
    assert [r["step"] for r in report.read_metrics(log)][:3] == [1, 2, 3]
    resume(tmp_path, "logged", report_to=["tensorboard", "wandb", "trackio"])
    assert_same_metrics(metrics(tmp_path / "logged"), runs.whole)
    expected = [row["reward"] for row in runs.whole]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "logged" / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("reward")
    assert [e.step for e in scalars] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in scalars] == pytest.approx(expected, rel=1e-6)

    history = wandb_history(tmp_path / "logged" / "wandb")
    assert [row["_step"] for row in history] == [1, 2, 3, 4, 5, 6]
    assert [row["reward"] for row in history] == pytest.approx(expected, rel=1e-6)

    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs("sage", "logged")
    assert [row["step"] for row in logs] == [1, 2, 3, 4, 5, 6]
    assert [row["reward"] for row in logs] == pytest.approx(expected, rel=1e-6)


def wandb_history(folder: Path) -> list[dict]:
    """The history rows in every offline W&B run file under `folder`, in write order.

    A ``.wandb`` file is a 7-byte header, then LevelDB-log style 32 KiB blocks of chunks (4-byte
    checksum, 2-byte length, 1-byte type: full / first / middle / last), each record a protobuf."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(folder.rglob("*.wandb")):
        data, records, pending, offset = path.read_bytes(), [], b"", 7
        while offset + 7 <= len(data):
            if (offset % 32768) + 7 > 32768:  # a block's tail too short for a chunk header is padding
                offset += 32768 - offset % 32768
                continue
            length, kind = int.from_bytes(data[offset + 4 : offset + 6], "little"), data[offset + 6]
            chunk, offset = data[offset + 7 : offset + 7 + length], offset + 7 + length
            if kind == 0 and length == 0:
                break
            pending += chunk
            if kind in (1, 4):  # full, or the last chunk of a record
                records.append(pending)
                pending = b""
        for raw in records:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_one_extreme_token_skips_the_optimizer_step_and_the_next_step_applies(tiny_config, distributed, zero_stage):
    """ref_logp - logp = +100 on one token of the batch: the loss is inf and the gradient non-finite.
    The optimizer step is skipped (weights, optimizer state and LR schedule untouched), said so in
    the metrics; the next batch, finite, is applied."""
    from tiny_models import step_context, tiny_model

    from sage_train.build import build_engines
    from sage_train.inputs import engine_config, run_settings
    from sage_train.models.loading import build_char_tokenizer
    from sage_train.policy import make_batch, score
    from sage_train.rollout import Completion
    from sage_train.step import policy_update

    tokenizer = build_char_tokenizer()
    cfg = tiny_config(algorithm="grpo", prompts_per_step=2, group_size=4, micro_batch_size=4, zero_stage=zero_stage)
    completions = [
        Completion(prompt_index=row // 4, prompt_ids=[5 + row, 7], completion_ids=[9, 10 + row, 11], text="")
        for row in range(8)
    ]
    batch = make_batch(completions, torch.device("cpu"), tokenizer.pad_token_id)
    advantages = torch.linspace(-1, 1, 8)
    model = tiny_model(tokenizer, seed=0, max_positions=64)
    reference = tiny_model(tokenizer, seed=0, max_positions=64).requires_grad_(False)
    s, cpu = run_settings(cfg), torch.device("cpu")
    engine, reference = build_engines(s.optim, model, reference, engine_config(s, 1, cpu), cpu, s.reward.beta != 0)
    ctx = step_context(cfg, engine, reference, tokenizer=tokenizer)
    old_logp, _ = score(engine, batch, 4, cfg.temperature)
    ref_logp, _ = score(reference, batch, 4, cfg.temperature)
    extreme = ref_logp.clone()
    extreme[3, -1] = old_logp[3, -1] + 100.0
    before = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    lr_before = engine.get_lr()[0]

    totals = policy_update(ctx, batch, advantages, old_logp, extreme, None)
    assert not torch.isfinite(totals.metrics(1)["loss"])
    assert totals.skipped == ["non-finite loss"]  # stage 2: DeepSpeed's own check skipped it, the loss says why
    assert totals.metrics(1)["nonfinite/skipped_steps"] == 1.0 and not engine.was_step_applied()
    for name, p in engine.module.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0, msg=name)
    if zero_stage == 0:
        assert not engine.optimizer.state  # Adam took no step: no moments, no step count
    assert engine.get_lr()[0] == lr_before and engine.skipped_steps == 1

    totals = policy_update(ctx, batch, advantages, old_logp, ref_logp, None)
    assert totals.skipped == [] and engine.was_step_applied()
    assert any(not torch.equal(p.detach(), before[name]) for name, p in engine.module.named_parameters())
