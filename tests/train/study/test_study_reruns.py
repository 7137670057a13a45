"""sage-study run again: a second study on the same --out stops at once, naming the one that holds
it, having written nothing; and a study killed after a run's last sample but before that run's
results.json finishes its evaluation when rerun (sage-eval then has nothing left to sample)."""

import hashlib
import json
from pathlib import Path

import yaml
from tiny_models import tiny_model

from sage_train.cli import study_main
from sage_train.models.loading import build_char_tokenizer
from sage_train.run_dir import RunLock
from sage_train.study.design import parse_study
from sage_train.study.grid import evaluate

ARGV = ["--algorithms", "grpo", "--seeds", "0", "--steps", "1", "--eval-n", "2", "--eval-problems", "2"]


def snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def test_a_second_study_on_one_out_names_the_holder_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "study"
    holder = RunLock(out, 0, owner="study", option="--out")
    holder.acquire()  # what the first study holds for its life
    try:
        (out / "runs" / "grpo-s0").mkdir(parents=True)
        (out / "runs" / "grpo-s0" / "metrics.jsonl").write_text('{"step": 1}\n')
        before = snapshot(out)
        for extra in ([], ["--report-only"]):
            assert study_main([*ARGV, "--out", str(out), *extra]) == 2
            err = capsys.readouterr().err.strip()
            assert "\n" not in err and "is in use by pid" in err and "choose another --out" in err, err
            assert snapshot(out) == before
    finally:
        holder.release()


def test_a_study_killed_before_a_runs_results_json_finishes_its_evaluation(tmp_path):
    study = parse_study([*ARGV, "--out", str(tmp_path / "study")])
    run_dir = tmp_path / "study" / "runs" / "grpo-s0"
    tokenizer = build_char_tokenizer()
    tiny_model(tokenizer, layers=1, max_positions=64).save_pretrained(run_dir / "final")
    tokenizer.save_pretrained(run_dir / "final")
    config = {
        "task": "arithmetic",
        "task_options": {"digits": 1},
        "eval_task": "",
        "max_new_tokens": 2,
        "eval_max_new_tokens": 0,
        "eval_temperature": 1.0,
    }
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    assert evaluate(study, run_dir, run_dir / "final", 0) == "ok"
    results = json.loads((run_dir / "study_eval" / "results.json").read_text())
    (run_dir / "study_eval" / "results.json").unlink()  # killed after the last record, before this
    assert evaluate(study, run_dir, run_dir / "final", 0) == "ok"
    again = json.loads((run_dir / "study_eval" / "results.json").read_text())
    assert again["generated"] == 0 and again["resumed"] == study.eval_problems
    pass_at_k = [r["models"]["grpo-s0"]["tasks"]["arithmetic"]["pass_at_k"] for r in (results, again)]
    assert pass_at_k[0] == pass_at_k[1]
