"""`sage-bench train --part step`: whole RL steps of sage-train beside TRL's GRPOTrainer on the same
real model, prompt pool and settings, each side in a fresh process.

The setting is the smollm2-arithmetic recipe's (`sage_train/configs/smollm2-arithmetic.yaml`):
SmolLM2-135M-Instruct, LoRA rank 16 / alpha 32 on every projection, 8 prompts x 8 completions per
step, at most 48 new tokens, temperature 1, beta 0.05, the GRPO loss type (each row's token mean),
clip 0.2, lr 1e-3, micro-batches of 16 rows, one optimizer step per generation. sage runs its
recipe (the branch guide on: the peer has none; it costs the loss a few percent); TRL 1.16 runs
``GRPOTrainer`` with ``per_device_train_batch_size=16``, ``gradient_accumulation_steps=4`` (so one
generation of 64 rows feeds one optimizer step, as ours), ``loss_type="grpo"``, the same LoRA via
``peft_config``, ``gradient_checkpointing`` as ours (``--gradient-checkpointing`` turns it on for both;
off by default, as sage-train's; TRL's own default is on),
and a reward that is the recipe task's own grader. Both draw their prompts from the same pool (the
first ``prompts x steps`` training problems of the recipe's seed, through the model's chat template).

Each side runs ``--steps`` optimizer steps in its own process (``python -m benchmarks.rl_step
sage|trl``); the last step is reported (the first builds the native operator and warms the
allocator). Parts, host wall clock: generation (sampling + grading), scoring (the reference
log-probs; sage also computes the behaviour log-probs, TRL skips them on-policy), update (loss +
backward + optimizer; TRL's includes the dataloader's bookkeeping), the whole step, completion
tokens and tokens/s (completion tokens / step seconds), and the process's resident high-water mark
(VmHWM) at the end of that step. sage's parts are its own metrics (``timing_s/*``); TRL's come from
timing its ``_generate`` / ``_calculate_rewards`` / ``_generate_and_score_completions`` methods.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sage_train.step_metrics import STEP_METRICS

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPE = "smollm2-arithmetic"
#: the step's parts this reports, and sage-train's metric of each
SAGE_PARTS = {
    "generate": STEP_METRICS.generate_s,
    "score": STEP_METRICS.score_s,
    "update": STEP_METRICS.update_s,
    "step": STEP_METRICS.step_time,
}
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def peak_rss_mib() -> float:
    """The process's resident high-water mark (VmHWM) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def recipe_config(model: str, steps: int, out: str, threads: int, checkpointing: bool = False):
    """The recipe's TrainConfig for a benchmark run: no evaluation, no plots, a pool of exactly the
    prompts `steps` steps draw."""
    from sage_train.config import parse_args, resolve

    recipe = parse_args(["--config", RECIPE])
    return resolve(
        parse_args(
            [
                "--config",
                RECIPE,
                f"--model={model}",
                f"--steps={steps}",
                f"--train_problems={recipe.prompts_per_step * steps}",
                "--eval_problems=0",
                f"--save_every={steps}",
                "--plots=false",
                f"--cpu_threads={threads}",
                f"--output_dir={out}",
                f"--gradient_checkpointing={str(checkpointing).lower()}",
            ]
        )
    )


def sage_worker(model: str, steps: int, threads: int, checkpointing: bool) -> dict:
    """`steps` steps of sage-train on the recipe; the last step's parts, tokens and peak RSS."""
    from sage_train.run import train

    with tempfile.TemporaryDirectory() as out:
        cfg = recipe_config(model, steps, out, threads, checkpointing)
        seen = {}

        def on_step(step: int, row: dict) -> None:
            if step == steps:
                seen.update(row, peak_rss_mib=peak_rss_mib())

        train(cfg, on_step=on_step)
    rows = cfg.prompts_per_step * cfg.group_size
    return {
        **{part: seen[name] for part, name in SAGE_PARTS.items()},
        "completion_tokens": seen[STEP_METRICS.mean_length] * rows,
        "reward": seen[STEP_METRICS.reward],
        "peak_rss_mib": seen["peak_rss_mib"],
    }


def trl_worker(model: str, steps: int, threads: int, checkpointing: bool) -> dict:
    """`steps` steps of TRL's GRPOTrainer in the recipe's setting (module docstring)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from sage_train.inputs import check_inputs
    from sage_train.models.loading import load_pretrained

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as out:
        cfg = recipe_config(model, steps, out, threads, checkpointing)
        plan = check_inputs(cfg, 1)
        task, train_problems = plan.task, plan.train_problems
        by_id = {p.id: p for p in train_problems}
        dataset = Dataset.from_list(
            [{"prompt": [{"role": "user", "content": task.prompt(p)}], "problem_id": p.id} for p in train_problems]
        )

        def reward(completions, problem_id, **_) -> list[float]:
            return [task.score(c[0]["content"], by_id[i]) for c, i in zip(completions, problem_id)]

        lm, tokenizer = load_pretrained(cfg.model)
        rows = cfg.prompts_per_step * cfg.group_size
        args = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            seed=cfg.seed,
            max_steps=steps,
            per_device_train_batch_size=cfg.micro_batch_size,
            gradient_accumulation_steps=rows // cfg.micro_batch_size,
            num_generations=cfg.group_size,
            max_completion_length=cfg.max_new_tokens,
            temperature=cfg.temperature,
            beta=cfg.beta,
            loss_type=cfg.loss_type,
            epsilon=0.2,
            scale_rewards="group",
            learning_rate=cfg.lr,
            lr_scheduler_type="constant",
            max_grad_norm=cfg.max_grad_norm,
            gradient_checkpointing=checkpointing,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_dropout=True,
            dataloader_num_workers=0,
        )
        peft = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=list(cfg.lora_target_modules),
            task_type="CAUSAL_LM",
        )
        trainer = GRPOTrainer(
            model=lm,
            reward_funcs=reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft,
        )
        spent = {"generate": 0.0, "score_all": 0.0}

        def timed(method, key):
            def call(*a, **k):
                start = time.perf_counter()
                try:
                    return method(*a, **k)
                finally:
                    spent[key] += time.perf_counter() - start

            return call

        trainer._generate = timed(trainer._generate, "generate")
        trainer._calculate_rewards = timed(trainer._calculate_rewards, "generate")
        trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "score_all")
        seen = {}

        class LastStep(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                spent.update(generate=0.0, score_all=0.0, start=time.perf_counter())

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == steps:
                    seen.update(spent, step=time.perf_counter() - spent["start"], peak_rss_mib=peak_rss_mib())

            def on_log(self, args, state, control, logs=None, **kwargs):
                # TRL logs these under sage-train's names
                if state.global_step == steps and logs and STEP_METRICS.mean_length in logs:
                    seen.update(mean_length=logs[STEP_METRICS.mean_length], reward=logs.get(STEP_METRICS.reward))

        trainer.add_callback(LastStep())
        trainer.train()
    return {
        "generate": seen["generate"],
        "score": seen["score_all"] - seen["generate"],
        "update": seen["step"] - seen["score_all"],
        "step": seen["step"],
        "completion_tokens": seen["mean_length"] * rows,
        "reward": seen["reward"],
        "peak_rss_mib": seen["peak_rss_mib"],
    }


WORKERS = {"sage": sage_worker, "trl": trl_worker}


def run_side(side: str, model: str, steps: int, threads: int, checkpointing: bool) -> dict:
    """One side in a fresh process; its result row (or {"failed": the last lines of its output})."""
    return run_worker("benchmarks.rl_step", side, model, str(steps), str(threads), str(int(checkpointing)))


def run_worker(module: str, *argv: str):
    """``python -m module argv...`` in a fresh process from the repository root: the JSON its last
    "RESULT " line prints, or {"failed": the last lines of its output}."""
    command = [sys.executable, "-m", module, *argv]
    # one process of its own: no rendezvous inherited from a launcher (accelerate would join it)
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    result_lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not result_lines:
        return {"failed": (done.stdout + done.stderr)[-2000:]}
    return json.loads(result_lines[-1][len("RESULT ") :])


def step_table(rows: list[dict]) -> str:
    """Medians per side of every part, tokens/s and peak RSS, and sage's ratio to TRL."""
    import statistics

    def median(side, key):
        values = [r[key] for r in rows if r["side"] == side and "failed" not in r]
        return statistics.median(values) if values else float("nan")

    lines = [
        "| side | generate s | score s | update s | step s | completion tokens | tokens/s | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for side in WORKERS:
        tokens_per_s = median(side, "tokens_per_s")
        lines.append(
            f"| {side} | {median(side, 'generate'):.1f} | {median(side, 'score'):.1f} | {median(side, 'update'):.1f} | "
            f"{median(side, 'step'):.1f} | {median(side, 'completion_tokens'):.0f} | {tokens_per_s:.1f} | "
            f"{median(side, 'peak_rss_mib'):.0f} |"
        )
    speed = median("sage", "tokens_per_s") / median("trl", "tokens_per_s")
    memory = median("sage", "peak_rss_mib") / median("trl", "peak_rss_mib")
    lines.append(f"\nsage / TRL: tokens/s x{speed:.2f}, peak RSS x{memory:.2f}")
    return "\n".join(lines) + "\n"


def main(args) -> list[dict]:
    """Both sides, alternating, ``args.repeats`` times; rows printed as they come."""
    rows = []
    for repeat in range(args.repeats):
        for side in WORKERS:
            load = os.getloadavg()[0]
            row = {
                "side": side,
                "repeat": repeat,
                "load_before": load,
                **run_side(side, args.model, args.steps, args.threads, args.gradient_checkpointing),
            }
            if "failed" not in row:
                row["tokens_per_s"] = row["completion_tokens"] / row["step"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    side, model, steps, threads, checkpointing = (
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5] == "1",
    )
    print("RESULT " + json.dumps(WORKERS[side](model, steps, threads, checkpointing)), flush=True)
