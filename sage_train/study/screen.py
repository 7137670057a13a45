"""Screen a study's seeds by their warm start alone: which seeds' SFT takes long.

    python -m sage_train.study.screen --config study-enrichment --seeds 400-459 --out DIR \
        --long 1300 --want 8 --jobs 2

Runs each seed's starting point (`sage-study`'s run `runs/start-s{seed}`: SFT to the config's target
loss, then its one RL step; no evaluation) in increasing seed order, and stops launching seeds once
the seeds screened so far hold `want` seeds whose SFT took at least `long` steps and `want` that took
fewer. The selection is by seed order, not by finishing order: the first `want` of each kind.
`sage-study --config ... --seeds <selected> --out DIR` then reuses these runs (a finished run is
not trained again) and evaluates them. Writes DIR/screen.json: every screened seed's SFT steps and
the selection. Nothing but the warm start's length is looked at.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from ..run_files import RUN_FILES
from ..safe_files import make_dir, open_append, write_file
from .design import START, parse_study
from .grid import finished, record_environment, worker_init
from .toy.sampled import seeds_of


def screen_seed(study, seed: int) -> int:
    """Train seed's starting point unless it finished; returns its SFT steps. In a worker process."""
    run_dir = study.run_dir(START, seed)
    if not finished(run_dir):
        from ..run import train

        make_dir(study.out / "logs")
        with open_append(study.out / "logs" / f"{run_dir.name}.log") as log:
            print(f"sage-study: {study.train_command(None, seed)}", file=log, flush=True)
        train(study.train_config_of(None, seed))
        if not finished(run_dir):
            raise RuntimeError(f"the starting point of seed {seed} did not finish ({run_dir})")
        record_environment(run_dir, "train")
    return json.loads((run_dir / RUN_FILES.sft / RUN_FILES.warm_start).read_text())["sft_steps"]


def selection(steps: dict, seeds: list, long: int, want: int) -> dict | None:
    """{"long": [...], "short": [...]}: the first `want` seeds of each kind in `seeds` order, once the
    screened prefix of `seeds` (every seed up to the last one chosen) holds them all; else None."""
    chosen = {"long": [], "short": []}
    for seed in seeds:
        if seed not in steps:
            return None  # a gap in the prefix: an earlier seed is still running
        kind = "long" if steps[seed] >= long else "short"
        if len(chosen[kind]) < want:
            chosen[kind].append(seed)
        if all(len(v) == want for v in chosen.values()):
            return chosen
    return None


def screen(study, seeds: list, long: int, want: int, log=print) -> dict:
    steps, started = {}, time.time()
    path = study.out / "screen.json"
    make_dir(study.out)
    context = multiprocessing.get_context("spawn")
    pool_args = dict(mp_context=context, initializer=worker_init, initargs=(context.Event(),))
    with ProcessPoolExecutor(study.jobs, **pool_args) as pool:
        queue, pending = list(seeds), {}
        while queue or pending:
            while queue and len(pending) < study.jobs and selection(steps, seeds, long, want) is None:
                seed = queue.pop(0)
                pending[pool.submit(screen_seed, study, seed)] = seed
            if not pending:
                break
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                seed = pending.pop(future)
                steps[seed] = future.result()
                kind = "long" if steps[seed] >= long else "short"
                log(f"screen: seed {seed}: SFT {steps[seed]} steps ({kind}) [{time.time() - started:.0f} s]")
            chosen = selection(steps, seeds, long, want)
            record = {"long_at_least": long, "want": want, "sft_steps": {str(s): steps[s] for s in sorted(steps)}}
            write_file(path, json.dumps({**record, "selected": chosen}, indent=1) + "\n")
            if chosen is not None:
                queue.clear()
    result = json.loads(path.read_text())
    log(f"screen: selected {result['selected']} (wrote {path})")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sage_train.study.screen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the study YAML whose starting points are screened")
    parser.add_argument("--seeds", required=True, help="'A-B' or a comma list, screened in this order")
    parser.add_argument("--out", required=True, help="the study directory")
    parser.add_argument("--long", type=int, default=1300, help="SFT steps at or above which a seed is long")
    parser.add_argument("--want", type=int, default=8, help="seeds of each kind to select")
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args(argv)
    study = parse_study(["--config", args.config, "--out", args.out, "--jobs", str(args.jobs)])
    screen(study, seeds_of(args.seeds), args.long, args.want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
