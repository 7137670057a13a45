"""`sage-bench train --part update`: sage-train's update (loss, backward, optimizer step) with its
micro-batches padded against packed (``padding_free``), at the demo's settings and the SmolLM2
recipe's, with the padding the packed layout does not compute.

Settings: ``demo`` is `sage-train` with no arguments (`tiny-cpu`: the tiny Qwen2-style model after
its SFT warm start, 32 prompts x 8 completions of at most 8 tokens, micro-batches of 64 rows,
1 thread); ``smollm2`` is ``--config smollm2-arithmetic`` (SmolLM2-135M-Instruct through its chat
template, LoRA r16, 8 x 8 completions of at most 48 tokens, micro-batches of 16 rows, 2 threads).
Layouts: ``padded`` (``padding_free: false``, each micro-batch as wide as the step's longest
sequence), ``packed`` (``padding_free: true``, one row per micro-batch) and ``packed, budget``
(packed, with micro-batches by ``max_tokens_per_micro_batch``: `BUDGETS`).

Each (setting, layout) runs in a fresh process: the run's own context (`sage_train.context`: the
warm start, the engines), then ``--steps`` RL steps, each one's generation first (sampling,
scoring) and then the step (`sage_train.step.rl_step`: the update) inside the peak-memory meter
(`benchmarks.measure.PeakMemory`: CUDA's allocator peak, or on the CPU the resident high-water mark
above the resident set after ``malloc_trim``). The first step is a warm-up (unless it is the only
one); each later one is a row.
Reported: the update's seconds (``timing_s/update``), tokens/s (the step's prompt and completion
tokens, padding not counted, over those seconds), the peak memory above the step's start, the
micro-batches, and the padding fraction: the share of the padded layout's positions (rows x the
step's width) that are padding, which the padded update computes and the packed one does not.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

from sage_train.step_metrics import STEP_METRICS

from .rl_step import run_worker

SETTINGS = {"demo": "tiny-cpu", "smollm2": "smollm2-arithmetic"}
LAYOUTS = {
    "padded": {"padding_free": False},
    "packed": {"padding_free": True},
    "packed, budget": {"padding_free": True, "budget": True},
}
#: the token budget of the "packed, budget" layout: about the tokens of one padded micro-batch's rows
BUDGETS = {"demo": 1024, "smollm2": 1536}


def setting_config(setting: str, layout: str, model: str, steps: int, out: str):
    """The setting's TrainConfig with the layout's keys: no evaluation, no plots, no checkpoints."""
    from sage_train.config import parse_args

    options = LAYOUTS[layout]
    argv = [
        "--config",
        SETTINGS[setting],
        f"--steps={steps}",
        "--eval_problems=0",
        f"--save_every={steps + 1}",
        "--plots=false",
        "--progress=false",
        f"--output_dir={out}",
        f"--padding_free={str(options['padding_free']).lower()}",
        f"--max_tokens_per_micro_batch={BUDGETS[setting] if options.get('budget') else 0}",
    ]
    if setting == "smollm2":
        argv.append(f"--model={model}")
    return parse_args(argv)


def worker(setting: str, layout: str, model: str, steps: int) -> list[dict]:
    """`steps` RL steps of the setting in this process; a row per step after the first."""
    import torch

    from sage_train.build import build_context
    from sage_train.distributed import init_distributed, seed_everything
    from sage_train.inputs import check_inputs
    from sage_train.micro_batches import split
    from sage_train.run_dir import prepare_run_dir
    from sage_train.step import generate, rl_step

    from .measure import PeakMemory

    rows = []
    with tempfile.TemporaryDirectory() as out:
        cfg = setting_config(setting, layout, model, steps, out)
        rank, world, device = init_distributed()
        plan = check_inputs(cfg, world, device)
        if device.type == "cpu" and cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        prepare_run_dir(cfg, cfg.run_dir, rank, world)
        seed_everything(cfg.seed + rank)
        ctx = build_context(plan, rank, device)
        ctx.rollout.sync_weights(ctx.engine.module.lm)
        meter = PeakMemory(device.type)
        for step in range(1, steps + 1):
            ctx.generation = generate(ctx, step)
            batch = ctx.generation.batch
            meter.start()
            metrics = rl_step(ctx, step)
            peak = meter.stop()
            real = int(batch.attention_mask.sum())
            micro_batches = len(split(batch, rows=cfg.micro_batch_size, max_tokens=cfg.max_tokens_per_micro_batch))
            update_s = metrics[STEP_METRICS.update_s]
            if step > 1 or steps == 1:  # the first step warms up, unless it is the only one
                rows.append(
                    {
                        "step": step,
                        "rows": batch.rows,
                        "width": batch.input_ids.shape[1],
                        "tokens": real,
                        "padding_fraction": 1 - real / batch.attention_mask.numel(),
                        "micro_batches": micro_batches,
                        "update_s": update_s,
                        "tokens_per_s": real / update_s,
                        "peak_mib": None if peak is None else peak / 2**20,
                        "padding_free": ctx.padding_free,
                    }
                )
    return rows


def run_variant(setting: str, layout: str, model: str, steps: int) -> list[dict]:
    """One (setting, layout) in a fresh process; its rows, or one {"failed": its last output}."""
    result = run_worker("benchmarks.packed_update", setting, layout, model, str(steps))
    return [result] if isinstance(result, dict) else result


def main(args, settings: list[str]) -> list[dict]:
    """Every setting x layout, ``args.repeats`` processes each, layouts alternating; rows printed as they come."""
    rows = []
    for setting in settings:
        for repeat in range(args.repeats):
            for layout in LAYOUTS:
                load = os.getloadavg()[0]
                for row in run_variant(setting, layout, args.model, args.steps):
                    row = {"setting": setting, "layout": layout, "repeat": repeat, "load_before": load, **row}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def update_table(rows: list[dict]) -> str:
    """Medians per setting and layout, and each layout's ratio to the padded one."""
    ok = [r for r in rows if "failed" not in r]

    def median(setting, layout, key):
        values = [r[key] for r in ok if r["setting"] == setting and r["layout"] == layout and r[key] is not None]
        return statistics.median(values) if values else float("nan")

    lines = [
        "| setting | layout | micro-batches | padding fraction | update s | tokens/s | peak MiB | tokens/s x padded "
        "| peak x padded | load (1-min) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setting in dict.fromkeys(r["setting"] for r in ok):
        for layout in LAYOUTS:
            mine = [r for r in ok if r["setting"] == setting and r["layout"] == layout]
            if not mine:
                continue
            speed = median(setting, layout, "tokens_per_s") / median(setting, "padded", "tokens_per_s")
            memory = median(setting, layout, "peak_mib") / median(setting, "padded", "peak_mib")
            loads = ", ".join(f"{value:.1f}" for value in dict.fromkeys(r["load_before"] for r in mine))
            lines.append(
                f"| {setting} | {layout} | {median(setting, layout, 'micro_batches'):.0f} | "
                f"{median(setting, layout, 'padding_fraction'):.3f} | {median(setting, layout, 'update_s'):.2f} | "
                f"{median(setting, layout, 'tokens_per_s'):.0f} | {median(setting, layout, 'peak_mib'):.0f} | "
                f"{speed:.2f} | {memory:.2f} | {loads} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    setting, layout, model, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    print("RESULT " + json.dumps(worker(setting, layout, model, steps)), flush=True)
