"""A study's design: its arms (algorithm presets with overrides), seeds, baseline, evaluation size,
pre-registered endpoints and the training config every run starts from, read from a study file
and the command line (`parse_study`) and checked before anything runs (`check_study`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from pathlib import Path

from ..config import TrainConfig, command_line_value, decimal_int, load
from ..config_files import read_mapping
from ..errors import ConfigError
from ..run_files import RUN_FILES

START = "start"  # the arm name of the starting point (the warm-started model, no RL)
STUDY_KEYS = (
    "algorithms",
    "seeds",
    "baseline",
    "eval_n",
    "eval_problems",
    "train_config",
    "train",
    "endpoints",
    "reuse",
    "frontier_k",
)


@dataclasses.dataclass(frozen=True)
class Arm:
    """One algorithm of the study: a preset and the training overrides that set it apart."""

    name: str
    algorithm: str
    overrides: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Study:
    arms: list
    seeds: list
    baseline: str  # the arm the paired differences are taken against
    eval_n: int
    eval_problems: int
    train_config: str  # the sage-train config every run starts from (a path or a packaged name)
    train: dict  # sage-train overrides common to every run
    out: Path
    jobs: int = 1
    # pre-registered paired differences, [{"arm", "versus", "k": [...]}], reported first
    endpoints: list = dataclasses.field(default_factory=list)
    # arms whose counts come from a committed study.json of the same setting and seeds rather than
    # from runs: {"study": path, "arms": [names]} (`reused_counts`); the seeds' starts still run, as
    # the new arms start from them, and their fresh counts are checked against the stored ones
    reuse: dict = dataclasses.field(default_factory=dict)
    frontier_k: int | None = None  # the frontier view's pass@k against pass@1 (None: eval_n)
    store: Path | None = None  # where each finished run's counts are also written (`grid.store_counts`)

    def run_dir(self, arm: str, seed: int) -> Path:
        return self.out / "runs" / f"{arm}-s{seed}"

    def train_overrides(self, arm: Arm | None, seed: int) -> dict:
        """The training keys of (arm, seed) over `train_config`; arm None is the seed's starting point."""
        values = {**self.train, "seed": seed, "output_dir": str(self.out / "runs"), "resume": True}
        values.update(progress=False, report_to=[], plots=False)  # the study draws its own plots
        if arm is None:  # the warm start only: one RL step (steps must be > 0), no evaluation
            values.update(name=f"{START}-s{seed}", steps=1, eval_problems=0)
        else:
            start = self.run_dir(START, seed) / RUN_FILES.sft
            values.update(arm.overrides, algorithm=arm.algorithm, name=f"{arm.name}-s{seed}")
            values.update(model=str(start), sft_steps=0, eval_problems=0)
        return values

    def train_config_of(self, arm: Arm | None, seed: int) -> TrainConfig:
        """The checked, resolved config of (arm, seed)'s run."""
        return load(self.train_config, self.train_overrides(arm, seed))

    def train_command(self, arm: Arm | None, seed: int) -> str:
        """The sage-train command line that reproduces (arm, seed)'s run (logged; the study calls `train`)."""
        keys = " ".join(f"--{k}={shlex.quote(_yaml_scalar(v))}" for k, v in self.train_overrides(arm, seed).items())
        return f"sage-train --config {shlex.quote(self.train_config)} {keys}"


def _yaml_scalar(value) -> str:
    """A value as sage-train reads it back (`config.command_line_value` of the text after `=`; YAML reads JSON)."""
    return value if isinstance(value, str) else json.dumps(value)


class StudyError(ValueError):
    """Bad study arguments or study file (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2 (through cli.study_main), not argparse's usage block
        raise StudyError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sage-study", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="a study YAML (path or packaged name, e.g. study-default)")
    p.add_argument("--algorithms", default=None, help="comma-separated presets, e.g. grpo,sage-branch")
    p.add_argument("--seeds", default=None, help="comma-separated training seeds, e.g. 0,1,2")
    p.add_argument("--baseline", default=None, help="the arm differences are taken against (default: the first)")
    p.add_argument("--steps", type=decimal_int, default=None, help="RL steps per run (a training override)")
    p.add_argument("--task", default=None, help="the task (a training override; resets task_options)")
    p.add_argument("--eval-n", type=decimal_int, default=None, help="samples per held-out problem (default 16)")
    p.add_argument("--eval-problems", type=decimal_int, default=None, help="held-out problems (default 64)")
    p.add_argument("--jobs", type=decimal_int, default=1, help="runs at once, each its own process")
    p.add_argument("--out", default=None, help="the study directory (required)")
    p.add_argument("--store", default=None, help="also write each finished run's counts here ({run}.json)")
    p.add_argument("--report-only", action="store_true", help="write the report from the runs finished so far")
    p.add_argument("--frontier", default=None, help="a stored study (study.json or its folder): its frontier only")
    p.add_argument("--toy", action="store_true", help="the closed-form toy study instead (sage_train.study.toy)")
    return p


def parse_study(argv: list) -> Study:
    """A Study from the command line: the study file's keys, then the flags, then --key=value."""
    args, rest = build_parser().parse_known_args(argv)
    if args.out is None:
        raise StudyError("--out DIR is required")
    values = read_study_file(args.config) if args.config else {}
    train = dict(values.get("train") or {})
    for arg in rest:  # training overrides pass through to every sage-train run
        key, has_value, text = arg.partition("=")
        if not key.startswith("--") or not has_value:
            raise StudyError(f"unexpected argument {arg!r}; training overrides are --key=value")
        try:  # read by the key's type, as sage-train reads it ("--rollout_rs_threshold=2_3" stays "2_3")
            train[key[2:].replace("-", "_")] = command_line_value(key[2:].replace("-", "_"), text)
        except ConfigError as error:
            raise StudyError(str(error)) from None
    if args.steps is not None:
        train["steps"] = args.steps
    if args.task is not None:  # another task's options would not fit it: its defaults unless given
        if args.task != train.get("task") and not any(arg.startswith("--task_options=") for arg in rest):
            train["task_options"] = {}
        train["task"] = args.task
    given = args.algorithms is not None  # an empty --algorithms names no algorithm: refused, not grpo
    arms = parse_arms(args.algorithms.split(",") if given else values.get("algorithms", ["grpo"]))
    seeds = _ints(args.seeds, "--seeds") if args.seeds is not None else values.get("seeds", [0])
    study = Study(
        arms=arms,
        seeds=seeds,
        baseline=args.baseline or values.get("baseline") or arms[0].name,
        eval_n=values.get("eval_n", 16) if args.eval_n is None else args.eval_n,
        eval_problems=values.get("eval_problems", 64) if args.eval_problems is None else args.eval_problems,
        train_config=values.get("train_config", "tiny-cpu"),
        train=train,
        out=Path(args.out),
        jobs=args.jobs,
        endpoints=values.get("endpoints") or [],
        reuse=values.get("reuse") or {},
        frontier_k=values.get("frontier_k"),
        store=Path(args.store) if args.store else None,
    )
    check_study(study)
    return study


def read_study_file(name: str) -> dict:
    try:
        values = read_mapping(name)
    except ConfigError as error:
        raise StudyError(str(error).replace("config file", "--config")) from None
    unknown = sorted(set(values) - set(STUDY_KEYS))
    if unknown:
        raise StudyError(f"--config {name!r}: unknown study key(s) {unknown}; known: {list(STUDY_KEYS)}")
    return values


def parse_arms(entries: list) -> list:
    """Arms from names ("grpo") or mappings ({name: sage-branch-tau0.3, algorithm: sage-branch, tau: 0.3})."""
    if not isinstance(entries, list) or not entries:
        raise StudyError(f"algorithms: expected a list of at least one preset, got {entries!r}")
    arms = []
    for entry in entries:
        if isinstance(entry, str) and entry.strip():
            arms.append(Arm(entry.strip(), entry.strip()))
        elif isinstance(entry, dict) and {"name", "algorithm"} <= set(entry):
            overrides = {k: v for k, v in entry.items() if k not in ("name", "algorithm")}
            arms.append(Arm(str(entry["name"]), str(entry["algorithm"]), overrides))
        else:
            raise StudyError(f"algorithms: expected a preset name or {{name, algorithm, key: value}}, got {entry!r}")
    names = [arm.name for arm in arms]
    if len(set(names)) < len(names) or START in names:
        raise StudyError(f"algorithms: names must be distinct and not {START!r}, got {names}")
    return arms


def check_study(study: Study) -> None:
    """Every value in range, and every run's sage-train config valid, before anything starts."""
    if not study.seeds or not all(isinstance(s, int) and s >= 0 for s in study.seeds):
        raise StudyError(f"seeds must be integers >= 0, got {study.seeds!r}")
    if len(set(study.seeds)) < len(study.seeds):
        raise StudyError(f"seeds: a seed is given twice: {study.seeds}")
    for key in ("eval_n", "eval_problems", "jobs"):
        value = getattr(study, key)
        if not isinstance(value, int) or value < 1:
            raise StudyError(f"{key.replace('_', '-')} must be an integer >= 1, got {value!r}")
    if study.frontier_k is not None and (
        type(study.frontier_k) is not int or not 1 <= study.frontier_k <= study.eval_n
    ):
        raise StudyError(f"frontier_k must be an integer in 1..eval_n={study.eval_n}, got {study.frontier_k!r}")
    check_reuse(study)
    if study.baseline not in [arm.name for arm in study.arms] + [START] + reused_arms(study):
        raise StudyError(f"baseline {study.baseline!r} is not one of the algorithms {[a.name for a in study.arms]}")
    check_endpoints(study)
    for arm in [None, *study.arms]:
        try:
            study.train_config_of(arm, study.seeds[0])
        except ConfigError as error:
            raise StudyError(f"{arm.name if arm else 'the starting-point run'}: {error}") from None


def reused_arms(study: Study) -> list:
    """The names of the arms whose counts the study reuses (`Study.reuse`), in the study file's order."""
    return list(study.reuse.get("arms", []))


def reused_study(study: Study) -> dict:
    """The committed study.json that `Study.reuse` names (a path from the working directory)."""
    path = Path(study.reuse["study"])
    if not path.is_file():
        raise StudyError(f"reuse: study {str(path)!r} is not a file (paths are from the working directory)")
    return json.loads(path.read_text())


def check_reuse(study: Study) -> None:
    """A reused arm comes from a study of the same setting (train block, evaluation size) that
    holds every seed of this one, and its name is not also an arm to run."""
    if not study.reuse:
        return
    if not isinstance(study.reuse, dict) or set(study.reuse) != {"study", "arms"}:
        raise StudyError(f"reuse: expected {{study: path, arms: [names]}}, got {study.reuse!r}")
    stored, arms = reused_study(study), reused_arms(study)
    if not isinstance(arms, list) or not arms or len(set(arms)) < len(arms):
        raise StudyError(f"reuse: arms must be a list of distinct names, got {arms!r}")
    clash = sorted(set(arms) & {arm.name for arm in study.arms})
    if clash:
        raise StudyError(f"reuse: arms {clash} are also algorithms to run")
    setting = stored["study"]
    for key in ("eval_n", "eval_problems", "train", "train_config"):
        if setting[key] != getattr(study, key):
            raise StudyError(f"reuse: the stored study's {key} differs from this study's: {setting[key]!r}")
    for arm in arms:
        missing = sorted(set(map(str, study.seeds)) - set(stored["counts"].get(arm, {})))
        if missing:
            raise StudyError(f"reuse: arm {arm!r} has no stored counts for seeds {missing}")


def check_endpoints(study: Study) -> None:
    names = [START, *(arm.name for arm in study.arms), *reused_arms(study)]
    for entry in study.endpoints:
        if not isinstance(entry, dict) or not {"arm", "versus", "k"} <= set(entry) <= {"arm", "versus", "k", "primary"}:
            raise StudyError(f"endpoints: expected {{arm, versus, k: [...], primary: true (optional)}}, got {entry!r}")
        if not isinstance(entry.get("primary", False), bool):
            raise StudyError(f"endpoints: primary must be true or false, got {entry['primary']!r}")
        for key in ("arm", "versus"):
            if entry[key] not in names:
                raise StudyError(f"endpoints: {key} {entry[key]!r} is not one of {names}")
        ks = entry["k"]
        if not isinstance(ks, list) or not ks or not all(type(k) is int and 1 <= k <= study.eval_n for k in ks):
            raise StudyError(f"endpoints: k must be a list of integers in 1..eval_n={study.eval_n}, got {ks!r}")


def _ints(text: str, what: str) -> list:
    try:
        return [decimal_int(x) for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError:
        raise StudyError(f"{what} must be comma-separated integers, got {text!r}") from None
