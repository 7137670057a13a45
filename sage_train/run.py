"""A training run: `train` builds what the run needs, warm-starts, evaluates, loops over RL steps
(`sage_train.step`) with checkpoints and reports, evaluates again and writes the summary.

Launch:

    sage-train                                      # the packaged tiny-cpu default (python -m sage_train too)
    sage-train --config my.yaml --algorithm=dapo --steps=300
    torchrun --nproc_per_node 2 -m sage_train --zero_stage=2             # several processes, one machine
    torchrun --nproc_per_node 8 -m sage_train --config my.yaml --zero_stage=3 --deepspeed_config=ds-zero3
    deepspeed --num_gpus 8 --module sage_train --config my.yaml          # DeepSpeed's launcher
    torchrun --nnodes 4 --node_rank R --master_addr HOST --nproc_per_node 8 -m sage_train ...  # many machines
    deepspeed --num_gpus 8 --module sage_train --config r1-distill-qwen-7b-sage-branch  # a paper recipe

The paper's recipes (LoRA, colocated vLLM rollouts, official hyperparameters) are packaged
configs; docs/recipes.md lists them with the one-machine and multi-node commands.

Each process takes ``prompts_per_step / world_size`` prompts per step; gradients are averaged
by DeepSpeed. CPU runs use the gloo backend and float32; GPU runs NCCL and bf16.

RL simplifications in force (as in TRL's GRPOTrainer unless said):
- Prompts are drawn without replacement within a step, from the first ``train_problems`` training
  problems (all when 0), by a generator seeded with (seed, step).
- One rollout batch per step, used for ``num_iterations`` optimizer steps (default 1, where the
  ratio is 1 and clipping is inert). No value model; the reward is the task verifier's 0/1.
- The policy's log-probs are those of the temperature-scaled distribution; the sampler's top-p /
  top-k / min-p truncation is ignored in them. The hf engine samples from the training weights
  themselves, so there is no staleness; its `sync_weights` only re-points it at the policy.
- Rollout engines that hold their own weights (``rollout_engine`` vllm, openai) receive the
  policy's weights after every optimizer step (``rollout/sync_time`` logs the cost). With
  ``tis_level`` token or sequence, the PG term is reweighted by truncated importance sampling,
  min(pi_train / pi_rollout, tis_cap), both temperature-scaled log-probs (`rollout_correction`);
  engines that report log-probs after top-p / min-p truncation (hf) then give weights <= 1 on
  truncated distributions, so leave those samplers off, or TIS off, with the hf engine.
- The reference is the policy at the start of RL (after the warm start), frozen. With LoRA
  (``lora_rank > 0``, `sage_train.lora`) it is that model with the adapter disabled: no copy.
- The KL term is a per-token loss term, not a reward penalty.
- The supervised warm start is a plain AdamW phase run identically on every rank (it needs no
  communication); it computes the model's logits, which the RL phase never does.
- Generation uses ``synced_gpus`` under ZeRO-3 so that ranks that finish early keep joining the
  collective gathers (`sage_train.policy` says how the LM head is gathered for the loss).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import checkpoint, report
from .build import build_engines, build_rollout, chat_prompted, check_batch_shape, make_guide, rollout_model_path
from .build import with_lora
from .config import ConfigError, TrainConfig
from .distributed import InterruptFlag, init_distributed, reduce_rows, seed_everything
from .evaluate import evaluate_engine, mean_pass_at_k
from .lora import base_lm, is_lora, merged_named_weights
from .rollout import SamplingParams
from .run_dir import prepare_run_dir
from .sft import initial_policy
from .step import Context, rl_step
from .tasks import get_task


def train(cfg: TrainConfig, on_step: Optional[Callable[[int, dict], None]] = None) -> dict:
    """Run `cfg` to the end (or to an interruption); returns the summary.

    on_step(step, row) is called on rank 0 after each logged step (tests use it to interrupt).
    """
    run_start = time.time()
    rank, world, device = init_distributed()
    check_batch_shape(cfg, world)
    if device.type == "cpu" and cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)  # tiny models run fastest on one thread per process
    run_dir = cfg.run_dir
    resume_step = prepare_run_dir(cfg, run_dir, rank)
    seed_everything(cfg.seed + rank)

    # models: the warm-started policy, and its frozen copy as the reference
    task = get_task(cfg.task, **cfg.task_options)
    sft_problems = list(task.problems("train", None, cfg.seed))
    train_problems = sft_problems[: cfg.train_problems] if cfg.train_problems else sft_problems
    if len(train_problems) < cfg.prompts_per_step:
        raise ConfigError(
            f"config key 'train_problems': {len(train_problems)} problems cannot fill "
            f"prompts_per_step={cfg.prompts_per_step}"
        )
    sft_task = task
    if cfg.sft_task and cfg.sft_steps:  # warm-start on another dataset's solutions
        sft_task = get_task(cfg.sft_task)
        sft_problems = list(sft_task.problems("train", None, cfg.seed))
    model, tokenizer = initial_policy(
        cfg, sft_task, sft_problems, run_dir, rank, resumed=resume_step is not None
    )
    rollout_init = rollout_model_path(cfg, model, tokenizer, run_dir, rank)
    if cfg.lora_rank:  # the reference is this model with the adapter disabled: no copy
        model, reference_lm = with_lora(model, cfg), None
    else:
        reference_lm = copy.deepcopy(model).requires_grad_(False).eval() if cfg.beta != 0 else None

    engine, reference = build_engines(cfg, model, reference_lm, world, device)
    rollout = build_rollout(cfg, engine.module.lm, tokenizer, rollout_init, device, rank, world)
    task = chat_prompted(cfg, task, tokenizer)
    guide = make_guide(cfg, rank)
    ctx = Context(
        cfg, engine, reference, rollout, tokenizer, task, train_problems, guide, rank, world, device
    )

    first_step = 1
    if resume_step is not None:
        first_step = checkpoint.load(engine, run_dir, guide) + 1
    rollout.sync_weights(engine.module.lm)  # the engine starts from the policy being trained
    eval_before = evaluate_once(ctx, run_dir / "eval_before.json")

    log = (
        report.MetricsLog(
            run_dir / "metrics.jsonl",
            resume_step=first_step - 1,
            tensorboard_dir=run_dir / "tensorboard" if cfg.tensorboard else None,
        )
        if rank == 0
        else None
    )
    bar = report.progress_bar(cfg.steps, first_step - 1, cfg.progress and rank == 0)
    interrupted = InterruptFlag()
    pending: list[tuple[int, dict]] = []
    step = first_step - 1
    with interrupted:
        for step in range(first_step, cfg.steps + 1):
            pending.append((step, rl_step(ctx, step)))
            bar.update(1)
            last = step == cfg.steps
            save = step % cfg.save_every == 0 or last
            if step % cfg.log_every == 0 or save:  # rows are flushed before any checkpoint
                rows = reduce_rows(pending, device)
                pending = []
                if rank == 0:
                    log.write(rows)
                    bar.set_postfix_str(report.progress_postfix(rows[-1]))
                    for row in rows:
                        if on_step is not None:
                            on_step(row["step"], row)
                stop = interrupted.agreed(device)
                if save or stop:
                    checkpoint.save(engine, run_dir, step, cfg, guide, keep=cfg.keep_checkpoints)
                if stop:
                    break
    bar.close()
    finished = step == cfg.steps and not interrupted.is_set
    eval_after = evaluate_once(ctx, run_dir / "eval_after.json") if finished else None
    if finished:
        save_final(engine, tokenizer, run_dir / "final", cfg, rank)
    summary = None
    if rank == 0:
        log.close()
        summary = write_summary(
            cfg, run_dir, step, eval_before, eval_after, time.time() - run_start, interrupted=not finished
        )
        print(report.format_summary(summary), flush=True)
    dist.barrier()
    return summary if rank == 0 else {}


def evaluate_once(ctx: Context, path: Path) -> Optional[dict]:
    """pass@1 and pass@k per split of ``eval_splits``, computed once (a resumed run reads the file).

    "train" samples the first ``eval_problems`` RL prompts, "test" as many held-out problems (of
    ``eval_task`` when set). Each rank evaluates an equal share of the problems (ZeRO-3 needs the
    same number of generate calls everywhere); the (n, c) counts are gathered over ranks."""
    cfg = ctx.cfg
    if cfg.eval_problems == 0 or not cfg.eval_splits:
        return None
    if path.is_file():
        return json.loads(path.read_text())
    results = {}
    for split in cfg.eval_splits:
        task = ctx.task
        if cfg.eval_task and split == "test":
            task = chat_prompted(cfg, get_task(cfg.eval_task), ctx.tokenizer)
        problems = (
            ctx.train_problems[: cfg.eval_problems]
            if split == "train"
            else list(task.problems("test", cfg.eval_problems, cfg.seed))
        )
        results[split] = pass_at_k_over_ranks(ctx, task, problems)
    if ctx.rank == 0:
        path.write_text(json.dumps(results, indent=1) + "\n")
    return results


def pass_at_k_over_ranks(ctx: Context, task, problems: list) -> dict:
    cfg = ctx.cfg
    share = len(problems) // ctx.world
    ks = sorted({1, cfg.eval_samples})
    sampling = SamplingParams(
        temperature=cfg.eval_temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        min_p=cfg.min_p,
        max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens,
        stop=tuple(cfg.stop),
    )
    result = evaluate_engine(
        ctx.rollout,
        task,
        problems[ctx.rank * share : (ctx.rank + 1) * share],
        n=cfg.eval_samples,
        ks=ks,
        sampling=sampling,
        seeds=[cfg.seed],
    )
    gathered = [None] * ctx.world
    dist.all_gather_object(gathered, [(r["n"], r["c"]) for r in result["problems"]])
    counts = [pair for part in gathered for pair in part]
    return {
        "problems": len(counts),
        "samples": cfg.eval_samples,
        **{f"pass@{k}": mean_pass_at_k(counts, k) for k in ks},
    }


def save_final(engine, tokenizer, path: Path, cfg: TrainConfig, rank: int) -> None:
    """The trained policy in HF format (model + tokenizer), loadable by AutoModelForCausalLM."""
    import deepspeed

    lm = engine.module.lm
    gather = deepspeed.zero.GatheredParameters(
        list(lm.parameters()), modifier_rank=None, enabled=cfg.zero_stage == 3
    )
    with gather:
        if rank == 0 and is_lora(lm):  # the adapter, and the merged model beside it
            lm.save_pretrained(path / "adapter")
            base_lm(lm).save_pretrained(path, state_dict=dict(merged_named_weights(lm)))
            tokenizer.save_pretrained(path)
        elif rank == 0:
            lm.save_pretrained(path)
            tokenizer.save_pretrained(path)
    dist.barrier()


def write_summary(
    cfg: TrainConfig,
    run_dir: Path,
    step: int,
    eval_before,
    eval_after,
    wall_time: float,
    *,
    interrupted: bool,
) -> dict:
    rows = report.read_metrics(run_dir / "metrics.jsonl")
    evals = {"before": eval_before, "after": eval_after}
    plot = report.plot_metrics(rows, run_dir / "metrics.png", evals) if cfg.plots else None
    summary = {
        "name": cfg.name,
        "algorithm": cfg.algorithm,
        "task": cfg.task,
        "steps_done": step,
        "steps": cfg.steps,
        "interrupted": interrupted,
        "wall_time_s": wall_time,
        **report.reward_trend(rows),
        "eval_before": eval_before,
        "eval_after": eval_after,
        "run_dir": str(run_dir),
        "final_model": None if interrupted else str(run_dir / "final"),
        "plot": str(plot) if plot else None,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
