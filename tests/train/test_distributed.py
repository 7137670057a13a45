"""Two processes on the CPU (gloo), launched by torchrun, with ZeRO-2 and ZeRO-3.

Each rank samples its own half of the prompts; under ZeRO-3 the LM head is gathered inside
the loss module, generation runs with synced_gpus, and micro-batches come from a token budget.
A short run must finish, log every step, checkpoint, evaluate across both ranks and save a
loadable final model."""

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml
from transformers import AutoModelForCausalLM

from sage_train import report


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stage", [2, 3])
def test_two_process_run(tmp_path, tiny_run, stage):
    config = {
        **tiny_run,
        "name": f"zero{stage}",
        "output_dir": str(tmp_path),
        "steps": 2,
        "sft_steps": 3,
        "eval_problems": 4,
        "eval_samples": 2,
        "zero_stage": stage,
        "prompts_per_step": 4,
        "micro_batch_size": 4,
    }
    if stage == 3:  # partition every parameter, the tiny LM head included (small ones stay whole by default)
        ds_path = tmp_path / "ds.json"
        ds_path.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
        config["deepspeed_config"] = str(ds_path)
        # micro-batches by a token budget (each rank's 8 rows hold ~70 tokens): their count may differ
        # between the ranks' rollouts, and every forward gathers the weights, so the ranks must agree on it
        config["max_tokens_per_micro_batch"] = 20
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "sage_train",
        "--config",
        str(path),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    run = tmp_path / f"zero{stage}"
    assert [row["step"] for row in report.read_metrics(run / "metrics.jsonl")] == [1, 2]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_after"]["test"]["problems"] == 4 and not summary["interrupted"]
    assert sorted(p.name for p in (run / "checkpoints" / "step000002").glob("rank*.pt")) == [
        "rank0.pt",
        "rank1.pt",
    ]
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert model.lm_head.weight.shape[1] == tiny_run["tiny_hidden_size"]
