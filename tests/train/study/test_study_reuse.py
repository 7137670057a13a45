"""sage-study's `reuse:` (a stored study's arms taken from its counts, not rerun) and `--store` (each
finished run's counts written as it finishes), on a real tiny grid."""

import json

import pytest

from sage_train.cli import study_main
from sage_train.study.report import recompute

TRAIN = [
    "--steps",
    "2",
    "--eval-n",
    "4",
    "--eval-problems",
    "5",
    "--sft_steps=150",
    "--prompts_per_step=4",
    "--group_size=4",
    "--micro_batch_size=16",
    "--task_options={digits: 1}",
    "--max_new_tokens=4",
]


@pytest.mark.slow
def test_reused_arms_come_from_the_stored_counts_and_runs_are_stored_as_they_finish(tmp_path, capsys):
    first = tmp_path / "first"
    assert study_main(["--algorithms", "grpo", "--seeds", "0,1", "--out", str(first), *TRAIN]) == 0
    stored = json.loads((first / "study.json").read_text())
    config = tmp_path / "reuse.yaml"
    config.write_text(
        f"reuse: {{study: {first / 'study.json'}, arms: [start, grpo]}}\nbaseline: grpo\nfrontier_k: 4\n"
        "endpoints: [{arm: sage-branch, versus: grpo, k: [4], primary: true}]\n"
    )
    second, store = tmp_path / "second", tmp_path / "store"
    argv = ["--config", str(config), "--algorithms", "sage-branch", "--seeds", "0,1", "--out", str(second)]
    assert study_main([*argv, "--store", str(store), *TRAIN]) == 0
    report = json.loads((second / "study.json").read_text())
    # grpo did not run here: its counts and curves are the stored study's; the start ran again
    # (sage-branch starts from it) and its fresh counts equal the stored ones
    assert not (second / "runs" / "grpo-s0").exists() and (second / "runs" / "start-s0" / "sft").is_dir()
    assert list(report["counts"]) == ["start", "grpo", "sage-branch"]
    assert report["counts"]["grpo"] == stored["counts"]["grpo"] and report["problems"] == stored["problems"]
    assert report["curves"]["grpo"] == stored["curves"]["grpo"]
    assert report["reuse"]["start_counts_identical"] == {"0": True, "1": True}
    assert report["arms"]["grpo"]["pass_at_k"] == stored["arms"]["grpo"]["pass_at_k"]
    assert [(row["arm"], row["versus"], row["seeds"]) for row in report["endpoints"]] == [
        ("sage-branch", "grpo", [0, 1])
    ]
    recomputed = json.loads(json.dumps(recompute(second / "study.json")))  # k as study.json writes it
    assert recomputed == {"arms": report["arms"], "endpoints": report["endpoints"]}
    # --store: one file per finished run of this study, with the counts study.json holds
    assert sorted(p.name for p in store.iterdir()) == [
        f"{a}-s{s}.json" for a in ("sage-branch", "start") for s in (0, 1)
    ]
    for arm in ("start", "sage-branch"):
        for seed in (0, 1):
            record = json.loads((store / f"{arm}-s{seed}.json").read_text())
            assert record["problems"] == report["problems"]
            assert {"n": record["n"], "correct": record["correct"]} == report["counts"][arm][str(seed)]
    assert json.loads((store / "sage-branch-s0.json").read_text())["last_metrics"]["step"] == 2
    capsys.readouterr()

    # a reused arm the stored study lacks a seed of, or another setting: refused, naming it
    assert study_main([*argv[:-4], "--seeds", "0,7", "--out", str(tmp_path / "x"), *TRAIN]) == 2
    assert "reuse: arm 'start' has no stored counts for seeds ['7']" in capsys.readouterr().err
    assert study_main([*argv, *TRAIN[:-1], "--max_new_tokens=5"]) == 2
    assert "reuse: the stored study's train differs" in capsys.readouterr().err
