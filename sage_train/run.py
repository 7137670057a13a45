"""A training run: `train` builds what the run needs, warm-starts, evaluates, loops over RL steps
(`sage_train.step`) with checkpoints and reports, evaluates again and writes the summary.

Launch:

    sage-train                                      # the packaged tiny-cpu default (python -m sage_train too)
    sage-train --config my.yaml --algorithm=dapo --steps=300
    torchrun --nproc_per_node 2 -m sage_train --zero_stage=2             # several processes, one machine
    torchrun --nproc_per_node 8 -m sage_train --config my.yaml --zero_stage=3 --deepspeed_config=ds-zero3
    deepspeed --num_gpus 8 --module sage_train --config my.yaml          # DeepSpeed's launcher
    torchrun --nnodes 4 --node_rank R --master_addr HOST --nproc_per_node 8 -m sage_train ...  # many machines
    sage-train --config r1-distill-qwen-7b-sage-branch                    # a paper recipe (one GPU)

The paper's recipes (LoRA, colocated vLLM rollouts, official hyperparameters) are packaged
configs; docs/recipes.md lists them with the one-machine and multi-node commands.

Each process takes ``prompts_per_step / world_size`` prompts per step; gradients are averaged
by DeepSpeed. CPU runs use the gloo backend and float32; GPU runs NCCL and bf16.

RL simplifications in force (as in TRL's GRPOTrainer unless said):
- Prompts are drawn without replacement within a step, from the first ``train_problems`` training
  problems (all when 0), by a generator seeded with (seed, step).
- One generation of rollouts feeds ``steps_per_generation`` optimizer steps (default 1; the
  official SAGE runs use 2, which makes every second step off-policy, `sage_train.step`), each
  batch used for ``num_iterations`` updates (default 1). With both at 1 the ratio is 1 and
  clipping is inert. No value model; the reward is the task verifier's 0/1.
- The policy's log-probs are those of the temperature-scaled distribution; the sampler's top-p /
  top-k / min-p truncation is ignored in them. The hf engine samples from the training weights
  themselves, so there is no staleness; its `sync_weights` only re-points it at the policy.
- Rollout engines that hold their own weights (``rollout_engine`` vllm, openai) receive the
  policy's weights after every optimizer step (``rollout/sync_time`` logs the cost of every push
  of the step). With ``tis_level`` token or sequence, the PG term is reweighted by truncated
  importance sampling, min(pi_train / pi_rollout, tis_cap) (`rollout_correction`), both
  log-probs of the temperature-scaled distribution before truncation (`sage_train.rl_maths`:
  vLLM's raw log-probs at temperature 1, as in the official code), so the weights are 1 where
  the engine and the trainer agree, min_p or not.
- The reference is the policy at the start of RL (after the warm start), frozen. With LoRA
  (``lora_rank > 0``, `sage_train.models.lora`) it is the model with the adapter disabled: no copy; after
  a warm start with ``sft_adapter: continue`` that is the raw pre-SFT base (the official SAGE way).
- The KL term is a per-token loss term, not a reward penalty.
- The supervised warm start is a plain AdamW phase run identically on every rank (it needs no
  communication); it computes the model's logits, which the RL phase never does.
- Generation uses ``synced_gpus`` under ZeRO-3 so that ranks that finish early keep joining the
  collective gathers (`sage_train.policy` says how the LM head is gathered for the loss).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint, report
from .build import build_context
from .config import TrainConfig
from .context import RunContext, RunSettings
from .distributed import InterruptFlag, init_distributed, on_rank0, reduce_rows, seed_everything
from .errors import ConfigError, RunError
from .eval.evaluate import evaluate_engine, mean_pass_at_k
from .inputs import check_inputs
from .models.files import ModelFilesError
from .models.lora import base_lm, is_lora, merged_named_weights
from .rollout import SamplingParams
from .run_dir import RunLock, discard_previous, prepare_run_dir, put_previous_back
from .run_files import RUN_FILES
from .safe_files import folder_written_atomically, write_atomically
from .step import rl_step


def train(cfg: TrainConfig, on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Run `cfg` to the end (or to an interruption); returns the summary: build the run's context,
    resume, evaluate before, the step loop, then finish (evaluate after, the final model, the summary).

    on_step(step, row) is called on rank 0 after each logged step (tests use it to interrupt).
    Bad input raises `ConfigError` before the run directory is touched (`sage_train.inputs`); the
    directory is locked for the run's life (`sage_train.run_dir`); a failure before the first step
    has run is one `ConfigError` naming the model, and leaves a run it would replace whole
    (`until_first_step`)."""
    run_start = time.time()
    rank, world, device = init_distributed()
    plan = check_inputs(cfg, world, device)
    run = plan.settings.run
    with RunLock(run.run_dir, rank):
        if device.type == "cpu" and run.cpu_threads:
            torch.set_num_threads(run.cpu_threads)  # tiny models run fastest on one thread per process
        resume_from, skipped = prepare_run_dir(cfg, run.run_dir, rank, world)
        with until_first_step(run, rank) as first_step_ran:
            seed_everything(run.seed + rank)
            ctx = build_context(plan, rank, device)
            first_step = 1 + (checkpoint.load(ctx.engine, resume_from, skipped, ctx.guide) if resume_from else 0)
            ctx.rollout.sync_weights(ctx.engine.module.lm)  # the engine starts from the policy being trained
            eval_before = evaluate_once(ctx, run.run_dir / RUN_FILES.eval_before)
            step, finished = step_loop(ctx, first_step, on_step, first_step_ran)
        return finish(ctx, step, finished, eval_before, run_start)


@contextmanager
def until_first_step(run: RunSettings, rank: int):
    """Until the run's first step has run (the model, tokenizer and chat template loaded and used),
    the run an ``overwrite`` replaces is kept aside (`run_dir.move_previous_aside`). Yields the call
    that says the first step ran, which deletes it; a failure before then puts it back whole. A model
    refused on loading (`ModelFilesError`) is one line in any run; with ``overwrite`` any failure that is
    not already one line (`ConfigError`, `RunError`) becomes one naming the model (the traceback of
    another run is kept: a resume's checkpoint, say, is no fault of the model)."""
    ran = []

    def first_step_ran() -> None:
        if not ran:
            ran.append(True)
            if rank == 0:
                discard_previous(run.run_dir)

    try:
        yield first_step_ran
    except BaseException as error:
        if ran:
            raise
        if rank == 0:
            put_previous_back(run.run_dir)
        if isinstance(error, ModelFilesError):  # its message names the model and the file
            raise ConfigError(f"config key 'model': {error}") from error
        if isinstance(error, (ConfigError, RunError)) or not isinstance(error, Exception) or not run.overwrite:
            raise
        first = (str(error).strip().splitlines() or [""])[0][:300]
        raise ConfigError(
            f"config key 'model': the run with model {run.model!r} failed before its first step ended "
            f"({type(error).__name__}: {first})"
        ) from error
    first_step_ran()  # a run with no step left to run


def step_loop(ctx: RunContext, first_step: int, on_step, first_step_ran: Callable[[], None] = lambda: None):
    """RL steps from `first_step` to the end, or to a stop signal agreed over ranks; metrics rows are
    flushed before every checkpoint; `first_step_ran` is called once the first has run. Returns (the
    last step done, whether the run finished)."""
    settings, rank = ctx.settings, ctx.rank
    run_dir, steps, logging, saves = settings.run.run_dir, settings.run.steps, settings.logging, settings.checkpoints
    log = None
    if rank == 0:
        log = report.MetricsLog(run_dir / RUN_FILES.metrics, resume_step=first_step - 1)
        log.loggers = report.make_loggers(logging, settings.saved, run_dir, log.history)
    bar = report.progress_bar(steps, first_step - 1, logging.progress and rank == 0)
    interrupted = InterruptFlag()
    pending: list[tuple[int, dict]] = []
    step = first_step - 1
    try:
        with interrupted:
            for step in range(first_step, steps + 1):
                pending.append((step, rl_step(ctx, step)))
                first_step_ran()
                bar.update(1)
                save = step % saves.save_every == 0 or step == steps
                if step % logging.log_every == 0 or save or ctx.stop:  # rows are flushed before any checkpoint
                    rows = reduce_rows(pending, ctx.device)
                    pending = []
                    if rank == 0:
                        log.write(rows)
                        bar.set_postfix_str(report.progress_postfix(rows[-1]))
                        for row in rows:
                            if on_step is not None:
                                on_step(row["step"], row)
                    if ctx.stop:  # agreed over ranks: each step's skip decision is
                        raise RunError(ctx.stop)
                    stop = interrupted.agreed(ctx.device)
                    if save or stop:
                        checkpoint.save(
                            ctx.engine, run_dir, step, settings.saved, ctx.guide, keep=saves.keep_checkpoints
                        )
                    if stop:
                        break
    finally:
        bar.close()
        if log is not None:
            log.close()
    return step, step == steps and not interrupted.is_set


def finish(ctx: RunContext, step: int, finished: bool, eval_before: dict | None, run_start: float) -> dict:
    """Evaluate after and save the final model (a finished run), then the summary (rank 0's; {} on
    the others)."""
    run = ctx.settings.run
    eval_after = evaluate_once(ctx, run.run_dir / RUN_FILES.eval_after) if finished else None
    if finished:
        zero3 = ctx.settings.optim.zero_stage == 3
        save_final(ctx.engine, ctx.tokenizer, run.run_dir / RUN_FILES.final, ctx.rank, gathered=zero3)
    summary = {}
    if ctx.rank == 0:
        summary = write_summary(
            run,
            ctx.settings.logging.plots,
            step,
            eval_before,
            eval_after,
            time.time() - run_start,
            interrupted=not finished,
        )
        print(report.format_summary(summary), flush=True)
    dist.barrier()
    return summary


def evaluate_once(ctx: RunContext, path: Path) -> dict | None:
    """pass@1 and pass@k per split of ``eval_splits``, computed once (a resumed run reads the file).

    "train" samples the first ``eval_problems`` RL prompts, "test" as many held-out problems (of
    ``eval_task`` when set; never RL prompts: `held_out_problems`). Each rank evaluates an equal
    share of the problems in one generate call per split (ZeRO-3 needs the same number of generate
    calls everywhere), each problem with its own seed; the (n, c) counts are gathered over ranks.
    The rollout engine stays awake for the whole evaluation: an engine holding its own weights
    loads them at most once."""
    evaluation = ctx.settings.evaluation
    if evaluation.eval_problems == 0 or not evaluation.eval_splits:
        return None
    if path.is_file():
        return json.loads(path.read_text())
    results = {}
    with ctx.rollout.awake():
        for split, (split_task, problems) in ctx.evaluations.items():
            results[split] = pass_at_k_over_ranks(ctx, split_task, problems)
    on_rank0(ctx.rank, lambda: write_atomically(path, json.dumps(results, indent=1) + "\n"))
    return results


def pass_at_k_over_ranks(ctx: RunContext, task, problems: list) -> dict:
    """pass@1 and pass@eval_samples of `problems`, and each problem's (id, n, correct) counts: this
    rank's equal share sampled in one generate call (`evaluate_engine`'s default), gathered over ranks."""
    samples, seed = ctx.settings.evaluation.eval_samples, ctx.settings.run.seed
    share = len(problems) // ctx.world
    ks = sorted({1, samples})
    sampling = SamplingParams.for_evaluation(ctx.settings.rollout)
    result = evaluate_engine(
        ctx.rollout,
        task,
        problems[ctx.rank * share : (ctx.rank + 1) * share],
        n=samples,
        ks=ks,
        sampling=sampling,
        seeds=[seed],
    )
    gathered = [None] * ctx.world
    dist.all_gather_object(gathered, [[r["problem_id"], r["n"], r["c"]] for r in result["problems"]])
    records = [record for part in gathered for record in part]
    counts = [(n, c) for _, n, c in records]
    return {
        "problems": len(counts),
        "samples": samples,
        **{f"pass@{k}": mean_pass_at_k(counts, k) for k in ks},
        "counts": records,  # [problem id, n, correct] per problem: the same problems before and after RL
    }


def save_final(engine, tokenizer, path: Path, rank: int, *, gathered: bool) -> None:
    """The trained policy in HF format (model + tokenizer), loadable by AutoModelForCausalLM; its
    parameters `gathered` first when ZeRO-3 partitions them."""
    import deepspeed

    lm = engine.module.lm
    gather = deepspeed.zero.GatheredParameters(list(lm.parameters()), modifier_rank=None, enabled=gathered)

    def write() -> None:
        with folder_written_atomically(path) as staged:
            if is_lora(lm):  # the adapter, and the merged model beside it
                lm.save_pretrained(staged / "adapter")
                base_lm(lm).save_pretrained(staged, state_dict=dict(merged_named_weights(lm)))
            else:
                lm.save_pretrained(staged)
            tokenizer.save_pretrained(staged)

    with gather:
        on_rank0(rank, write)
    dist.barrier()


def write_summary(
    run: RunSettings,
    plots: bool,
    step: int,
    eval_before,
    eval_after,
    wall_time: float,
    *,
    interrupted: bool,
) -> dict:
    run_dir = run.run_dir
    rows = report.read_metrics(run_dir / RUN_FILES.metrics)
    evals = {"before": eval_before, "after": eval_after}
    plot = report.plot_metrics(rows, run_dir / RUN_FILES.plot, evals) if plots else None
    summary = {
        "name": run.name,
        "algorithm": run.algorithm,
        "task": run.task,
        "steps_done": step,
        "steps": run.steps,
        "interrupted": interrupted,
        "wall_time_s": wall_time,
        **report.reward_trend(rows),
        "eval_before": eval_before,
        "eval_after": eval_after,
        "run_dir": str(run_dir),
        "final_model": None if interrupted else str(run_dir / RUN_FILES.final),
        "plot": str(plot) if plot else None,
    }
    write_atomically(run_dir / RUN_FILES.summary, json.dumps(summary, indent=1) + "\n")
    return summary
