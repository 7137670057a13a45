"""pilot-premise (docs/results/pilot.md): the setting where GRPO lost held-out coverage is
study-arithmetic's training with the task's pool of 1000 problems, and sage-train accepts it."""

import dataclasses
import json

from sage_train.config import parse_args, read_yaml


def test_pilot_premise_is_study_arithmetic_with_the_default_pool_and_grpo():
    pilot = parse_args(["--config", "pilot-premise"])
    assert pilot.algorithm == "grpo" and pilot.guide == "none" and pilot.beta == 0.05 and pilot.kl == "k3"
    assert pilot.task == "arithmetic" and pilot.task_options == {"digits": 2, "ops": "+", "grading": "strict"}
    assert pilot.train_problems == 1000 and pilot.steps == 600 and pilot.eval_samples == 256

    study = read_yaml("study-arithmetic")
    argv = ["--config", study["train_config"], "--algorithm=grpo"]
    argv += [f"--{key}={json.dumps(value)}" for key, value in study["train"].items()]
    reference = parse_args(argv)
    differ = {f.name for f in dataclasses.fields(pilot) if getattr(pilot, f.name) != getattr(reference, f.name)}
    # what the run is called and reports, plus the pool: the training itself is the study's
    assert differ == {"name", "seed", "train_problems", "eval_splits", "eval_samples"}
    assert reference.train_problems == 7000
