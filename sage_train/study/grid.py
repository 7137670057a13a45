"""`sage-study`: a grid of algorithms x seeds run as ordinary `sage-train` runs, every final model
and its starting point evaluated on the same held-out problems with `sage-eval`, and the results
aggregated with confidence intervals (`sage_train.study.report`).

    sage-study --algorithms grpo,sage-branch --seeds 0,1 --steps 10 --eval-n 16 --out DIR
    sage-study --config study-default --jobs 2 --out /tmp/study-default     # the packaged study
    sage-study --config study-default --out DIR --lr=1e-3                   # a training override

What lands in --out:

    runs/start-s{seed}/    the starting point of `seed`: a sage-train run of the base config (one RL
                           step, not evaluated) whose warm start `sft/` every algorithm of that seed
                           starts from (--model=.../sft --sft_steps=0), so the algorithms of one seed
                           differ only in RL: the pairing of the paired differences
    runs/{arm}-s{seed}/    one algorithm ("arm": an algorithm preset plus overrides, e.g. a tau) and seed
    runs/*/study_eval/     sage-eval's records of that run's model (the start's: its sft/)
    runs/*/study_env.json  the environment (library versions, commit, machine) that trained and
                           evaluated the run (`sage_train.environment`)
    logs/                  each subprocess's output
    study.json, study.md, pass_at_k.png, training_curves.png

Resumable: a run whose summary.json says it finished is reused; an unfinished one continues from
its newest checkpoint (every run is launched with --resume); sage-eval resumes from its records.
Killing the study (Ctrl-C, SIGTERM) starts nothing more and stops the runs in flight (at a
checkpoint when in the RL loop); the same command then finishes the grid. A study killed outright
(kill -9) takes its workers with it (`_die_with_parent`). One study at a time holds
--out (study.lock): a second stops naming the first, having written nothing. With --jobs N, N worker
processes run at once, one torch thread each; each run is `sage_train.run.train` of its sage-train
config, in a worker (so torch and DeepSpeed are imported once per worker, not once per run); its
log starts with the sage-train command line that reproduces it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import yaml

from ..errors import ConfigError
from ..run_files import RUN_FILES
from ..safe_files import make_dir, open_append, refuse_links, write_atomically
from .design import START, Arm, Study, StudyError, parse_study
from .report import write_report

NOT_STARTED = "not started: the study was stopped"


def run_task(study: Study, arm: Arm | None, seed: int) -> str:
    """Train (arm, seed) unless finished, then evaluate its model; runs in a worker process, its
    output going to logs/{run}.log. arm None is the seed's starting point (its sft/ is evaluated).
    Once the study is stopping, nothing new starts: a task the pool hands out afterwards returns."""
    with _stoppable():
        if _stop.is_set():  # checked after SIGTERM unwinds the task: the event is set before the signal
            return NOT_STARTED
        return _run(study, arm, seed)


def _run(study: Study, arm: Arm | None, seed: int) -> str:
    run_dir = study.run_dir(arm.name if arm else START, seed)
    log_path = study.out / "logs" / f"{run_dir.name}.log"
    with open_append(log_path) as log, _output_to(log):
        if not finished(run_dir):
            from ..run import train

            print(f"sage-study: {study.train_command(arm, seed)}", flush=True)
            summary = train(study.train_config_of(arm, seed))
            if not finished(run_dir):
                return f"sage-train {'stopped' if summary and summary.get('interrupted') else 'failed'} ({log_path})"
            record_environment(run_dir, "train")
        if _stop.is_set():
            return "trained, not evaluated: the study was stopped"
        return evaluate(study, run_dir, run_dir / (RUN_FILES.sft if arm is None else RUN_FILES.final), seed)


def record_environment(run_dir: Path, stage: str) -> None:
    """Adds {stage: environment} to run_dir/study_env.json: what trained (or evaluated) this run."""
    from ..environment import environment

    path = run_dir / RUN_FILES.study_env
    recorded = json.loads(path.read_text()) if path.is_file() else {}
    recorded[stage] = environment()
    write_atomically(path, json.dumps(recorded, indent=1) + "\n")


def evaluate(study: Study, run_dir: Path, model: Path, seed: int) -> str:
    """sage-eval of `model` on the study's held-out problems into run_dir/study_eval (resumable)."""
    out = run_dir / RUN_FILES.study_eval
    if eval_done(out, study):
        return "ok (reused)"
    config = yaml.safe_load((run_dir / RUN_FILES.config).read_text())
    from ..eval.command import run_eval
    from ..eval.settings import command_line, options, resolve_settings

    args = options(
        model=[str(model)],
        tasks=config.get("eval_task") or config["task"],
        task_options="{}" if config.get("eval_task") else json.dumps({config["task"]: config["task_options"]}),
        n=study.eval_n,
        k=",".join(map(str, range(1, study.eval_n + 1))),
        seeds=str(seed),
        limit=study.eval_problems,
        out=str(out),
        max_new_tokens=config.get("eval_max_new_tokens") or config["max_new_tokens"],
        temperature=config["eval_temperature"],
        device="cpu" if _cpu_only() else "cuda",
        no_progress=True,
    )
    print(f"sage-study: {command_line(args)}", flush=True)
    code = run_eval(resolve_settings(args))
    if code == 0 and eval_done(out, study):
        record_environment(run_dir, "eval")
        return "ok"
    return f"sage-eval exited {code}"


def _cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


@contextlib.contextmanager
def _output_to(log):
    """The worker's stdout and stderr (file descriptors: C++ and logging output too) into `log`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


_stop = threading.Event()  # in a worker: the study's stop event (`worker_init`), set once it is stopping


def worker_init(stop) -> None:
    """Workers leave Ctrl-C to the study, which sets `stop` and signals them with SIGTERM
    (`stop_workers`); an idle worker ignores it. A worker dies with the study (`_die_with_parent`).
    Each is a world of one on a port of its own: a launcher's (or the caller's) rank variables are
    dropped."""
    global _stop
    _stop = stop
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    import torch

    torch.set_num_threads(1)  # tiny models: one thread per worker is fastest, and --jobs shares the cores


def _die_with_parent() -> None:
    """A study that ends without stopping its workers (kill -9, a crash) takes them with it: a thread
    of the worker waits on the study's sentinel (a pipe the kernel closes when the study's process
    ends, however it ends) and kills the worker, which would otherwise go on training and
    evaluating into --out after the study's lock is gone. Its run resumes from its last checkpoint,
    as after any kill."""
    parent = multiprocessing.parent_process()
    if parent is None:  # not a spawned worker
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-the-study", daemon=True).start()


@contextlib.contextmanager
def _stoppable():
    """SIGTERM during a task raises KeyboardInterrupt in it rather than killing the worker: the RL
    loop installs its own handler (a checkpoint, then it returns); anywhere else (warm start,
    evaluation, a compiler lock held while an extension builds) the task unwinds and releases
    what it holds, and the worker lives on."""

    def interrupt(*_):
        raise KeyboardInterrupt("stopped by sage-study")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_workers(state: dict) -> None:
    """Nothing new starts (the workers' stop event), and SIGTERM to the workers: a run in its RL
    loop saves a checkpoint and returns; one in its warm start or evaluation unwinds (`_stoppable`;
    both resume)."""
    state["stopping"] = True
    if "stop" in state:
        state["stop"].set()
    for child in multiprocessing.active_children():
        os.kill(child.pid, signal.SIGTERM)


def finished(run_dir: Path) -> bool:
    summary = run_dir / RUN_FILES.summary
    return summary.is_file() and not json.loads(summary.read_text()).get("interrupted", True)


def eval_done(out: Path, study: Study) -> bool:
    results = out / "results.json"
    if not results.is_file():
        return False
    config = json.loads(results.read_text())["config"]
    return config["n"] == study.eval_n and config["limit"] == study.eval_problems


def store_counts(study: Study, arm: str, seed: int) -> None:
    """{store}/{arm}-s{seed}.json: the run's per-problem correct counts as study.json stores them
    (with the problem ids, the run's metrics file's last row and its environment), written as each
    run finishes so a study's counts are kept (e.g. committed) while it is still running."""
    from ..report import read_metrics
    from .report import collect_counts

    single = dataclasses.replace(study, seeds=[seed])
    problems, counts = collect_counts(single, [arm])
    run_dir = study.run_dir(arm, seed)
    metrics = read_metrics(run_dir / RUN_FILES.metrics) if (run_dir / RUN_FILES.metrics).is_file() else []
    env = run_dir / RUN_FILES.study_env
    record = {
        "arm": arm,
        "seed": seed,
        **counts[arm][str(seed)],
        "problems": problems,
        "last_metrics": metrics[-1] if metrics else None,
        "environment": json.loads(env.read_text()) if env.is_file() else None,
    }
    make_dir(study.store)
    write_atomically(study.store / f"{arm}-s{seed}.json", json.dumps(record) + "\n")


def run_grid(study: Study, state: dict, log=print) -> dict:
    """Every start, then every (arm, seed) once its start is done, in `study.jobs` worker processes
    (each imports torch once); returns {run name: status}."""
    statuses, total, started = {}, len(study.seeds) * (len(study.arms) + 1), time.time()
    make_dir(study.out / "logs")
    context = multiprocessing.get_context("spawn")
    state["stop"] = context.Event()
    if state["stopping"]:  # a signal before the event existed
        state["stop"].set()
    workers = dict(mp_context=context, initializer=worker_init, initargs=(state["stop"],))
    with ProcessPoolExecutor(study.jobs, **workers) as pool:
        pending = {pool.submit(run_task, study, None, seed): (None, seed) for seed in study.seeds}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            if state["stopping"]:  # the queue is dropped; what a worker already holds returns at once
                for future in pending:
                    future.cancel()
            for future in done:
                arm, seed = pending.pop(future)
                name = f"{arm.name if arm else START}-s{seed}"
                try:
                    statuses[name] = NOT_STARTED if future.cancelled() else future.result()
                except (Exception, KeyboardInterrupt) as error:  # a task unwound by the stop signal, or a crash
                    statuses[name] = f"{'stopped' if state['stopping'] else 'failed'}: {type(error).__name__}"
                log(f"sage-study: [{len(statuses)}/{total}] {name}: {statuses[name]} ({time.time() - started:.0f} s)")
                if study.store is not None and statuses[name].startswith("ok"):
                    store_counts(study, arm.name if arm else START, seed)
                if arm is None and statuses[name].startswith("ok") and not state["stopping"]:
                    for each in study.arms:
                        pending[pool.submit(run_task, study, each, seed)] = (each, seed)
    return statuses


def main(argv=None) -> int:
    """`sage-study`; returns the exit status (2: bad arguments, 1: some run failed, 130: stopped)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--toy" in argv:
        return toy_main(argv)
    if any(arg.split("=")[0] == "--frontier" for arg in argv):
        from .frontier import main as frontier_main

        return frontier_main(argv)
    study = parse_study(argv)
    with _one_study_at_a_time(study.out):
        return run_study(study, argv)


@contextlib.contextmanager
def _one_study_at_a_time(out: Path):
    """Hold --out's study.lock (`run_dir.RunLock`): a second study on it stops naming the holder,
    having written nothing; so does a link among --out's files (`safe_files`)."""
    from ..run_dir import RunLock

    lock = RunLock(out, 0, owner="study", option="--out")
    try:
        refuse_links(out.parent, [out.name], "sage-study --out in")
        lock.acquire()
    except ConfigError as error:
        raise StudyError(str(error)) from None
    try:
        yield
    finally:
        lock.release()


def run_study(study: Study, argv: list) -> int:
    if "--report-only" in argv:
        print(write_report(study, argv, wall_time_s=None)["summary"])
        return 0
    state, started = {"stopping": False}, time.time()
    previous = {sig: signal.signal(sig, lambda *_: stop_workers(state)) for sig in (signal.SIGINT, signal.SIGTERM)}
    print(f"sage-study: {len(study.arms)} algorithm(s) x {len(study.seeds)} seed(s) + starting points -> {study.out}")
    try:
        statuses = run_grid(study, state)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if state["stopping"]:
        print(f"sage-study: stopped; finished runs are kept, rerun the same command to finish {study.out}")
        return 130
    report = write_report(study, argv, wall_time_s=time.time() - started)
    print(report["summary"])
    failed = {name: status for name, status in statuses.items() if not status.startswith("ok")}
    for name, status in failed.items():
        print(f"sage-study: {name}: {status}")
    return 1 if failed else 0


def toy_main(argv: list) -> int:
    """`sage-study --toy --out DIR ...`: the closed-form toy study, written by `sage_train.study.toy.command`."""
    parser = argparse.ArgumentParser(prog="sage-study --toy", add_help=False)
    parser.add_argument("--out", default=None)
    args, rest = parser.parse_known_args([arg for arg in argv if arg != "--toy"])
    if args.out is None:
        raise StudyError("--toy needs --out DIR")
    from .toy.command import main as run_toys  # imported here: only the toy study needs it

    return run_toys(["--out", args.out, *rest])
