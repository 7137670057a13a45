"""`SAGEGRPOTrainer` under accelerate's FSDP2 (`fully_shard`) on two CPU processes (gloo) against one
process on the same data: 3 steps' logged losses and metrics and the trained weights, for an untied
LM head and for tied embeddings (SmolLM2's layout).

FSDP2 is switched on as a TRL user switches it on, ``fsdp=True, fsdp_config={"version": 2}`` in the
config (accelerate's ``FullyShardedDataParallelPlugin(fsdp_version=2)``), and accelerate prepares the
model itself (`fsdp2_prepare_model`: each decoder layer, the embedding and the [final norm, LM head]
tail their own ``fully_shard`` unit; the reference model through TRL's `prepare_fsdp`). One switch is
ours: accelerate 1.16 applies an FSDP plugin only on accelerator devices and silently trains with
DDP on CPU, so this program sets the state accelerate sets for a GPU (`fsdp_on_cpu`).

The completions are the model's own samples (TRL's generation, FSDP2's synchronised ranks), seeded
per prompt (`rollout`, TRL's ``rollout_func``), so one process and two draw the same ones. The
optimizer is SGD: Adam divides by sqrt(v) + eps, which turns a gradient entry that cancels to about
eps into an update that float32 rounding (one process's sum or two processes' reduce-scatter) moves
by a percent of the learning rate; with SGD the weights differ as the gradients do.

Each run is a fresh set of processes; this file is also their program:
``python test_trl_fsdp2.py OUT_DIR MODEL_DIR...`` (WORLD_SIZE, RANK: torchrun's variables).
"""

import itertools
import json
import os
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

STEPS = 3
COMPARED = ("loss", "grad_norm", "kl", "entropy", "sage/q_mean", "sage/q_min", "sage/q_max", "reward", "reward_std")
COMPARED += ("clip_ratio/region_mean", "completions/mean_length")


def fsdp_on_cpu() -> None:
    """Let accelerate's FSDP plugin act on CPU processes: the three assignments accelerate's
    `AcceleratorState` makes when it is given the plugin on a GPU machine."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def init_with_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init_with_fsdp


def rollout(prompts: list[str], trainer) -> dict:
    """TRL's own generation, one prompt group at a time, each seeded by its prompt: whichever process
    holds a prompt, and however many there are, it gets the same completions."""
    prompt_ids, completion_ids = [], []
    for prompt, group in itertools.groupby(prompts):  # the sampler repeats each prompt num_generations times
        ids = trainer.processing_class(text=list(group))["input_ids"]
        torch.manual_seed(zlib.crc32(prompt.encode()))
        completions, _ = trainer._generate_single_turn(ids, None, {}, len(ids))
        prompt_ids += ids
        completion_ids += completions
    return dict(prompt_ids=prompt_ids, completion_ids=completion_ids, logprobs=[[0.0] * len(c) for c in completion_ids])


def train(out_dir: str, model_dirs: list[str]) -> None:
    from datasets import Dataset
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor
    from transformers import AutoTokenizer

    from sage_kernels.integrations.trl import SAGEGRPOConfig, SAGEGRPOTrainer

    world = int(os.environ["WORLD_SIZE"])
    fsdp = dict(fsdp=True, fsdp_config={"version": 2}) if world > 1 else {}
    if fsdp:
        fsdp_on_cpu()
    for index, model_dir in enumerate(model_dirs):
        args = SAGEGRPOConfig(
            output_dir=out_dir,
            per_device_train_batch_size=8 // world,  # the same 8 completions (2 prompts) per step
            num_generations=4,
            max_completion_length=6,
            max_steps=STEPS,
            optim="sgd",
            learning_rate=0.1,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            bf16=False,
            use_cpu=True,
            seed=0,
            sage_tau=0.5,
            loss_type="dapo",
            **fsdp,
        )
        trainer = SAGEGRPOTrainer(
            model_dir,
            reward_funcs=lambda completions, **kw: [
                sum(ch in "abcde" for ch in c) / max(len(c), 1) for c in completions
            ],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["ab", "ba", "ca", "ac", "bb", "aa", "cb", "bc"]}),
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            rollout_func=rollout,
        )
        trainer.train()
        model = trainer.model
        weights = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone().contiguous()
            for name, p in model.named_parameters()
        }
        if trainer.accelerator.is_main_process:
            save_file(weights, str(Path(out_dir) / f"weights{index}.safetensors"))
            run = dict(
                logs=[entry for entry in trainer.state.log_history if "sage/q_mean" in entry],
                sharded=isinstance(model.get_output_embeddings().weight, DTensor),
                tied=model.get_output_embeddings().weight is model.get_input_embeddings().weight,
            )
            (Path(out_dir) / f"run{index}.json").write_text(json.dumps(run))


def start(world: int, model_dirs: list[str], out_dir: Path) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_dir.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "WORLD_SIZE": str(world)}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    command = [sys.executable, __file__, str(out_dir), *model_dirs]
    processes = []
    for rank in range(world):
        with open(out_dir / f"rank{rank}.log", "w") as log:
            rank_env = env | {"RANK": str(rank), "LOCAL_RANK": str(rank)}
            processes.append(subprocess.Popen(command, env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    return processes


def finish(processes: list[subprocess.Popen], out_dir: Path, count: int) -> list:
    from safetensors.torch import load_file

    for process in processes:
        try:
            process.wait(timeout=900)
        except subprocess.TimeoutExpired:
            process.kill()
    for rank, process in enumerate(processes):
        assert process.returncode == 0, (out_dir / f"rank{rank}.log").read_text()[-3000:]
    return [
        (json.loads((out_dir / f"run{i}.json").read_text()), load_file(str(out_dir / f"weights{i}.safetensors")))
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def tied_lm_dir(tiny_lm_dir, tmp_path_factory):
    """The tiny Qwen2 with its LM head tied to its embedding, as SmolLM2's."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen2-tied")
    config = AutoConfig.from_pretrained(tiny_lm_dir)
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    Qwen2ForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_lm_dir).save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_fsdp2_on_two_processes_equals_one_process(tiny_lm_dir, tied_lm_dir, tmp_path):
    from safetensors.torch import load_file

    model_dirs = [tiny_lm_dir, tied_lm_dir]
    # both runs at once: most of each is importing, one core each
    running = {world: start(world, model_dirs, tmp_path / f"world{world}") for world in (1, 2)}
    one, two = (finish(running[world], tmp_path / f"world{world}", len(model_dirs)) for world in (1, 2))
    for model_dir, (run1, weights1), (run2, weights2) in zip(model_dirs, one, two):
        tied = model_dir == tied_lm_dir
        assert run2["sharded"] and not run1["sharded"]  # FSDP2 did shard the head
        assert run1["tied"] == run2["tied"] == tied  # and kept the tie
        assert len(run1["logs"]) == len(run2["logs"]) == STEPS
        for entry1, entry2 in zip(run1["logs"], run2["logs"]):
            for name in COMPARED:
                assert entry2[name] == pytest.approx(entry1[name], rel=1e-4, abs=1e-6), (
                    model_dir,
                    name,
                    entry1["step"],
                )
        assert weights1.keys() == weights2.keys()
        for name, w1 in weights1.items():
            torch.testing.assert_close(weights2[name], w1, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        # the head moved far beyond the tolerance: a gradient missing a rank's share would show
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        assert (weights1[head] - load_file(str(Path(model_dir) / "model.safetensors"))[head]).abs().max() > 1e-3


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2:])
