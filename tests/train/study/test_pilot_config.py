"""pilot-premise (docs/results/pilot.md): the setting where GRPO lost held-out coverage is
study-arithmetic's training with the task's pool of 1000 problems, and sage-train accepts it."""

import dataclasses
import json
from pathlib import Path

from sage_train.config import parse_args
from sage_train.config_files import read_mapping
from sage_train.presets import loss_config
from sage_train.study.design import parse_study


def test_pilot_premise_is_study_arithmetic_with_the_default_pool_and_grpo():
    pilot = parse_args(["--config", "pilot-premise"])
    assert pilot.algorithm == "grpo" and pilot.guide == "none" and pilot.beta == 0.05 and pilot.kl == "k3"
    assert pilot.task == "arithmetic" and pilot.task_options == {"digits": 2, "ops": "+", "grading": "strict"}
    assert pilot.train_problems == 1000 and pilot.steps == 600 and pilot.eval_samples == 256

    study = read_mapping("study-arithmetic")
    argv = ["--config", study["train_config"], "--algorithm=grpo"]
    argv += [f"--{key}={json.dumps(value)}" for key, value in study["train"].items()]
    reference = parse_args(argv)
    differ = {f.name for f in dataclasses.fields(pilot) if getattr(pilot, f.name) != getattr(reference, f.name)}
    # what the run is called and reports, plus the pool: the training itself is the study's
    assert differ == {"name", "seed", "train_problems", "eval_splits", "eval_samples"}
    assert reference.train_problems == 7000


def test_study_decisive_trains_the_pilot_setting_on_fresh_seeds_with_its_registered_endpoints(tmp_path):
    study = parse_study(["--config", "study-decisive", "--out", str(tmp_path)])  # every run's config checked
    assert len(study.seeds) >= 8 and not {100, 101} & set(study.seeds)
    assert study.eval_n >= 256 and study.eval_problems >= 512 and study.baseline == "grpo"
    arms = {arm.name: (arm.algorithm, arm.overrides) for arm in study.arms}
    assert arms == {
        "grpo": ("grpo", {}),
        "grpo-beta1.4x": ("grpo-beta1.4x", {}),
        "sage-branch": ("sage-branch", {"tau": 0.95}),
        "sage-branch-tau1.2": ("sage-branch", {"tau": 1.2}),
        "sage-branch-exact": ("sage-branch-exact", {"tau": 0.95}),
        "grpo-no-kl": ("grpo-no-kl", {}),
    }
    assert study.endpoints[:2] == [
        {"arm": "sage-branch", "versus": "grpo", "k": [1, 64], "primary": True},
        {"arm": "sage-branch-exact", "versus": "grpo", "k": [1, 64], "primary": True},
    ]
    pilot = parse_args(["--config", "pilot-premise"])
    for arm in study.arms:  # the training is the pilot's but for the seed, the arm and what the study sets
        run = study.train_config_of(arm, study.seeds[0])
        differ = {f.name for f in dataclasses.fields(run) if getattr(run, f.name) != getattr(pilot, f.name)}
        assert differ - {"name", "seed", "output_dir", "resume", "progress", "report_to", "plots"} - {
            "model",
            "sft_steps",
            "eval_problems",
            "eval_splits",
            "eval_samples",
            "algorithm",
        } <= {"beta", "guide", "tau", "kl_in_reward"}, (arm.name, differ)
    resolved = {arm.name: study.train_config_of(arm, 200) for arm in study.arms}
    assert resolved["grpo-beta1.4x"].beta == 0.07 and resolved["grpo-no-kl"].beta == 0.0
    assert resolved["sage-branch"].guide == "branch" and resolved["sage-branch"].tau == 0.95
    exact = resolved["sage-branch-exact"]  # beta weighs the KL in the reward; the loss gets none
    assert exact.kl_in_reward and exact.beta == 0.05 and loss_config(exact).beta == 0.0


def test_each_runs_logged_command_line_reproduces_its_config(tmp_path):
    """The study calls `train` with a config; the command line it logs gives sage-train that same config."""
    import shlex

    from sage_train.study.design import parse_study

    study = parse_study(["--config", "study-decisive", "--out", str(tmp_path / "a b")])  # a space to quote
    for arm in [None, *study.arms]:
        command = shlex.split(study.train_command(arm, 203))
        assert command[0] == "sage-train"
        assert parse_args(command[1:]) == study.train_config_of(arm, 203)


def test_study_kl_in_reward_is_the_decisive_setting_with_its_registered_arms(tmp_path):
    """The follow-up's training keys are the decisive study's, key for key; its seeds are new and
    its first endpoint is the guide's share inside the KL-in-reward form."""
    decisive = read_mapping("study-decisive")
    followup = read_mapping("study-kl-in-reward")
    assert followup["train"] == decisive["train"] and followup["eval_n"] == decisive["eval_n"]
    assert followup["eval_problems"] == decisive["eval_problems"]
    assert not set(followup["seeds"]) & (set(decisive["seeds"]) | {100, 101}) and len(followup["seeds"]) >= 8
    study = parse_study(["--config", "study-kl-in-reward", "--out", str(tmp_path)])  # every run's config checked
    resolved = {arm.name: study.train_config_of(arm, 300) for arm in study.arms}
    plain, exact = resolved["grpo-kl-in-reward"], resolved["sage-branch-exact"]
    assert plain.kl_in_reward and plain.guide == "none" and plain.beta == 0.05
    assert exact.kl_in_reward and exact.guide == "branch" and exact.tau == 0.95 and exact.beta == 0.05
    assert study.endpoints[0] == {
        "arm": "sage-branch-exact",
        "versus": "grpo-kl-in-reward",
        "k": [1, 64],
        "primary": True,
    }


def test_study_enrichment_is_the_decisive_setting_with_start_and_grpo(tmp_path):
    """Stage 1 of issue 38: the decisive study's training keys, key for key; grpo and its start."""
    decisive, stage1 = read_mapping("study-decisive"), read_mapping("study-enrichment")
    assert stage1["train"] == decisive["train"] and stage1["eval_n"] == decisive["eval_n"] == 256
    assert stage1["eval_problems"] == decisive["eval_problems"] == 512
    study = parse_study(["--config", "study-enrichment", "--seeds", "400", "--out", str(tmp_path)])
    assert [arm.name for arm in study.arms] == ["grpo"] and study.endpoints[0]["k"] == [1, 64, 256]


def test_study_confirmatory_is_the_decisive_setting_with_stage_2s_registered_arms_and_primaries(tmp_path):
    """Stage 2 of issue 38: the decisive study's training keys, key for key; the active guide and the
    beta matched to its mean q as fixed in docs/results/confirmatory/design.json; three primaries."""
    decisive, stage2 = read_mapping("study-decisive"), read_mapping("study-confirmatory")
    assert stage2["train"] == decisive["train"] and stage2["eval_n"] == 256 and stage2["eval_problems"] == 512
    design = json.loads(
        (Path(__file__).resolve().parents[3] / "docs" / "results" / "confirmatory" / "design.json").read_text()
    )
    study = parse_study(["--config", "study-confirmatory", "--seeds", "600", "--out", str(tmp_path)])
    resolved = {arm.name: study.train_config_of(arm, 600) for arm in study.arms}
    assert set(resolved) == {
        "grpo",
        "grpo-beta1.4x",
        "sage-branch-active",
        "grpo-beta-matched",
        "grpo-kl-in-reward",
        "sage-branch-exact",
    }
    for name in ("sage-branch-active", "sage-branch-exact"):
        run = resolved[name]
        assert (run.guide, run.tau, run.gamma, run.beta) == ("branch", design["tau"], design["gamma"], 0.05)
    assert resolved["sage-branch-exact"].kl_in_reward and resolved["grpo-kl-in-reward"].kl_in_reward
    assert not resolved["sage-branch-active"].kl_in_reward and resolved["grpo-kl-in-reward"].guide == "none"
    assert resolved["grpo-beta-matched"].beta == design["beta_matched"] == round(0.05 * design["mean_q"], 4)
    assert resolved["grpo-beta-matched"].guide == "none" and resolved["grpo-beta1.4x"].beta == 0.07
    assert [(e["arm"], e["versus"], e["k"]) for e in study.endpoints if e.get("primary")] == [
        ("grpo", "start", [64]),
        ("sage-branch-active", "grpo-beta-matched", [64]),
        ("sage-branch-exact", "grpo-kl-in-reward", [64]),
    ]
