"""Grading: a task's own scores of completions, and math answers graded by math-verify under a
hard time limit per call.

`math_reward(completion, gold)` parses the gold answer and the completion with math-verify
(the completion's last `\\boxed{}` or, failing that, its final answer as math-verify extracts
it) and returns 1.0 when they are equivalent, else 0.0. `math_rewards(pairs)` grades many at
once on all worker processes.

Why worker processes: sympy can spend minutes (or forever) inside C code on an answer such
as `9^{9^{9^{9}}}`, and math-verify's own timeout is `signal.alarm`, which only works on the
main thread and cannot interrupt C code. Here the grading runs in a small persistent pool of
worker processes; the caller waits on a pipe with a deadline, and a worker that misses it
is killed and replaced, the answer scores 0 and the timeout is counted (`grading_stats()`).
No signal is ever installed in the caller's process, so any thread may call these functions.
Inside the workers math-verify's signal timeouts are switched off: the kill is the limit.

A worker starts in about a second (importing sympy); a killed one is replaced at once and
its replacement warms up while the other workers go on grading. POSIX only (pipes passed to
a subprocess, SIGALRM in the workers).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path

DEFAULT_TIMEOUT_S = 5.0
# Time a fresh worker may take to start (import sympy) before it counts as broken.
_STARTUP_TIMEOUT_S = 120.0


# ----------------------------------------------------------------------------- worker side

#: a gold answer marked with this prefix is parsed as it is, not boxed (`math_rewards(box_gold=False)`)
_BARE = "\x00bare\x00"


def _gold_text(gold: str) -> str:
    """Gold answers are bare LaTeX ("\\frac{14}{3}", "p - q"); boxing them makes math-verify
    parse the whole string as one answer (bare, it extracts only a number from "3\\sqrt{13}").
    The official SAGE evaluation parses them bare: `_BARE`-marked golds are left so."""
    if gold.startswith(_BARE):
        return gold[len(_BARE) :]
    return gold if "\\boxed" in gold else "\\boxed{" + gold + "}"


def _grade_in_worker(completion: str, gold: str, gold_cache: dict) -> float:
    from math_verify import parse, verify

    parsed_gold = gold_cache.get(gold)
    if parsed_gold is None:
        # Evaluation grades hundreds of samples against one gold: parse it once per worker.
        parsed_gold = parse(_gold_text(gold), parsing_timeout=None)
        if len(gold_cache) > 4096:
            gold_cache.clear()
        gold_cache[gold] = parsed_gold
    if not parsed_gold:
        return 0.0
    answer = parse(completion, parsing_timeout=None)
    if not answer:
        return 0.0
    return 1.0 if verify(parsed_gold, answer, timeout_seconds=None) else 0.0


def _worker_main(read_fd: int, write_fd: int, self_destruct_s: int) -> None:
    """Serve (completion, gold) requests arriving on `read_fd` until the parent closes it.

    The parent kills a worker that overruns; but if the parent itself dies, nobody would stop
    one stuck in C code. So each grading also arms this process's own SIGALRM with its default
    action (the kernel terminates the process, GIL or not), `self_destruct_s` seconds out, after
    the parent's limit."""
    import math_verify  # noqa: F401  (import before announcing readiness)

    # Its signal timeouts are off (the parent kills us instead); silence the warning that says so.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    requests, replies = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    gold_cache: dict = {}
    replies.send("ready")
    while True:
        try:
            completion, gold = requests.recv()
        except (EOFError, OSError):
            return
        signal.alarm(self_destruct_s)
        try:
            score = _grade_in_worker(completion, gold, gold_cache)
        except Exception:  # a malformed answer is a wrong answer, never a crash
            score = 0.0
        signal.alarm(0)
        replies.send(score)


# ----------------------------------------------------------------------------- parent side


class _Worker:
    """One grading process and the parent's ends of its two pipes.

    A plain subprocess rather than `multiprocessing`: spawn and forkserver children re-import
    the caller's `__main__` (breaking scripts without a main guard, notebooks, pytest), and
    fork would copy a process that may be running torch threads.
    """

    def __init__(self, timeout_s: float):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        package_root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p))
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from sage_train.tasks.grading import _worker_main; "
                f"_worker_main({to_child_r}, {from_child_w}, {math.ceil(timeout_s) + 5})",
            ],
            pass_fds=(to_child_r, from_child_w),
            env=env,
            stdin=subprocess.DEVNULL,
            # Its own session: a Ctrl-C meant for the caller does not kill graders mid-reply.
            start_new_session=True,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self.requests = Connection(to_child_w, readable=False)
        self.conn = Connection(from_child_r, writable=False)
        self.ready = False

    def send(self, item) -> None:
        self.requests.send(item)

    def wait_ready(self) -> None:
        if self.ready:
            return
        if not self.conn.poll(_STARTUP_TIMEOUT_S) or self.conn.recv() != "ready":
            self.kill()
            raise RuntimeError(f"a math grading worker did not start within {_STARTUP_TIMEOUT_S:.0f} s")
        self.ready = True

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
        self.requests.close()
        self.conn.close()


class GradingPool:
    """A fixed number of grading processes shared by all threads of this process.

    processes: how many workers (grading is CPU-bound; each call uses as many as it has items).
    timeout_s: the hard limit on one (completion, gold) grading, in seconds.
    """

    def __init__(self, processes: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S):
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.processes = processes
        self.timeout_s = float(timeout_s)
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._stats = {"calls": 0, "timeouts": 0, "worker_errors": 0}
        self._closed = False
        for _ in range(processes):
            self._add_worker()

    def _add_worker(self) -> None:
        worker = _Worker(self.timeout_s)
        with self._lock:
            self._all.append(worker)
        self._idle.put(worker)

    def _replace(self, worker: _Worker, stat: str) -> None:
        worker.kill()
        with self._lock:
            self._stats[stat] += 1
            if worker in self._all:  # not after close()
                self._all.remove(worker)
        if not self._closed:
            self._add_worker()

    def _checkout(self, wanted: int) -> list[_Worker]:
        """At least one worker (waiting for it), plus up to `wanted - 1` more that are idle now."""
        workers = [self._idle.get()]
        while len(workers) < wanted:
            try:
                workers.append(self._idle.get_nowait())
            except queue.Empty:
                break
        for i, worker in enumerate(workers):
            try:
                worker.wait_ready()
            except RuntimeError:
                for other in workers[i + 1 :]:
                    self._idle.put(other)
                self._replace(worker, "worker_errors")
                raise
        return workers

    def grade(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """Scores (1.0 / 0.0) of (completion, gold) pairs, in order."""
        if self._closed:
            raise RuntimeError("this GradingPool is closed")
        scores = [0.0] * len(pairs)
        if not pairs:
            return scores
        with self._lock:
            self._stats["calls"] += len(pairs)
        todo = list(range(len(pairs)))[::-1]
        free: list[_Worker] = []
        busy: dict[Connection, tuple[_Worker, int, float]] = {}
        try:
            while todo or busy:
                if todo and not free and not busy:
                    free = self._checkout(len(todo))
                while todo and free:
                    worker, index = free.pop(), todo.pop()
                    completion, gold = pairs[index]
                    try:
                        worker.send((str(completion), str(gold)))
                    except OSError:  # it died while idle: replace it and grade this pair elsewhere
                        todo.append(index)
                        self._replace(worker, "worker_errors")
                        continue
                    busy[worker.conn] = (worker, index, time.monotonic() + self.timeout_s)
                if not busy:
                    continue
                next_deadline = min(deadline for _, _, deadline in busy.values())
                for conn in wait(list(busy), timeout=max(0.0, next_deadline - time.monotonic())):
                    worker, index, _ = busy.pop(conn)
                    try:
                        scores[index] = float(conn.recv())
                        free.append(worker)
                    except (EOFError, OSError):  # the worker died (e.g. out of memory): score 0
                        self._replace(worker, "worker_errors")
                now = time.monotonic()
                for conn, (worker, index, deadline) in list(busy.items()):
                    if now >= deadline:
                        del busy[conn]
                        self._replace(worker, "timeouts")
        finally:
            # An exception mid-batch (e.g. KeyboardInterrupt) leaves busy workers with a reply
            # in flight: they cannot be reused, so they are replaced.
            for worker, _, _ in busy.values():
                self._replace(worker, "worker_errors")
            for worker in free:
                self._idle.put(worker)
        return scores

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def pids(self) -> list[int]:
        """Process ids of the workers."""
        with self._lock:
            return [worker.process.pid for worker in self._all]

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers, self._all = list(self._all), []
        for worker in workers:
            worker.kill()


_pool: GradingPool | None = None
_pool_pid: int | None = None
_pool_lock = threading.Lock()


def _default_processes() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _shared_pool() -> GradingPool:
    global _pool, _pool_pid
    with _pool_lock:
        # A forked child (e.g. a data loader worker) must not share its parent's pipes.
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = GradingPool(_default_processes()), os.getpid()
        return _pool


def math_reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer equals `gold` per math-verify, else 0.0.

    Never raises on bad input; a grading that exceeds the time limit scores 0.0.
    """
    return _shared_pool().grade([(completion, gold)])[0]


def math_rewards(pairs: Iterable[tuple[str, str]], *, box_gold: bool = True) -> list[float]:
    """`math_reward` of many (completion, gold) pairs, graded in parallel on the worker pool.
    ``box_gold=False`` parses the golds bare, as the official SAGE evaluation does (on MATH-500
    about a fifth of the golds then parse differently, some not at all: those score 0)."""
    if not box_gold:
        pairs = [(completion, _BARE + gold) for completion, gold in pairs]
    return _shared_pool().grade(list(pairs))


def grading_stats() -> dict:
    """Counters of the shared pool: calls, timeouts (graded 0) and worker_errors (graded 0)."""
    with _pool_lock:
        pool = _pool if _pool_pid == os.getpid() else None
    return pool.stats() if pool is not None else {"calls": 0, "timeouts": 0, "worker_errors": 0}


@atexit.register
def _shutdown() -> None:
    if _pool is not None and _pool_pid == os.getpid():
        _pool.close()
