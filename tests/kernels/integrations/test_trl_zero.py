"""`SAGEGRPOTrainer` under DeepSpeed ZeRO-3, one CPU process: the LM head, partitioned to an empty
tensor outside its module's forward, is gathered for the fused loss, and a few training steps
equal ZeRO-0's (the logged losses and metrics, the trained parameters).

Each run is a fresh process (DeepSpeed's ZeRO-3 patches module construction process-wide); this
file is also that process's program: ``python test_trl_zero.py STAGE MODEL_DIR OUT_DIR``.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("deepspeed")

STEPS = 3
COMPARED = ("loss", "kl", "entropy", "sage/q_mean", "sage/q_max", "clip_ratio/region_mean", "reward")


def train(stage: int, model_dir: str, out_dir: str) -> None:
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from sage_kernels.integrations.trl import SAGEGRPOConfig, SAGEGRPOTrainer

    zero = {"stage": stage}
    if stage == 3:  # partition everything, the tiny LM head included
        zero["stage3_param_persistence_threshold"] = 0
    args = SAGEGRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=STEPS,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        seed=0,
        sage_tau=0.5,
        loss_type="dapo",
        deepspeed={
            "zero_optimization": zero,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
        },
    )
    trainer = SAGEGRPOTrainer(
        model_dir,
        reward_funcs=lambda completions, **kw: [c.count("a") / max(len(c), 1) for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["ab", "ba", "ca", "ac", "bb", "aa", "cb", "bc"]}),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    trainer.train()
    params = dict(trainer.model.named_parameters())
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            weights = {name: p.detach().clone().contiguous() for name, p in params.items()}
    else:
        weights = {name: p.detach().clone().contiguous() for name, p in params.items()}
    save_file(weights, str(Path(out_dir) / "weights.safetensors"))
    logs = [entry for entry in trainer.state.log_history if "sage/q_mean" in entry]
    (Path(out_dir) / "logs.json").write_text(json.dumps(logs))


def run(stage: int, model_dir: str, out_dir: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    command = [sys.executable, __file__, str(stage), model_dir, str(out_dir)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    from safetensors.torch import load_file

    return json.loads((out_dir / "logs.json").read_text()), load_file(str(out_dir / "weights.safetensors"))


def test_zero3_equals_zero0(tiny_lm_dir, tmp_path):
    (logs0, weights0), (logs3, weights3) = (run(s, tiny_lm_dir, tmp_path / f"zero{s}") for s in (0, 3))
    assert len(logs0) == len(logs3) == STEPS
    for entry0, entry3 in zip(logs0, logs3):
        for name in COMPARED:
            assert entry3[name] == pytest.approx(entry0[name], rel=1e-4, abs=1e-6), (name, entry0["step"])
    assert weights0.keys() == weights3.keys()
    changed = 0
    for name, w0 in weights0.items():
        torch.testing.assert_close(weights3[name], w0, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        changed += int(not torch.equal(w0, load_initial(tiny_lm_dir)[name]))
    assert changed > 0  # the steps trained the model


def load_initial(model_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


if __name__ == "__main__":
    train(int(sys.argv[1]), sys.argv[2], sys.argv[3])
