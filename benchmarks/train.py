"""`sage-bench train`: the RL step's parts on a real model, side by side with TRL's.

``--part generation``: rollout throughput of the trainer's hf engine (`sage_train.rollout.hf`: one
generator per row, the prompt's KV cache computed once per group), as the model is (float32) and
sampling from a bfloat16 copy (``hf_rollout_dtype: bfloat16``), against the generation TRL's
GRPOTrainer does without vLLM, on the same prompts and settings. TRL's path (trl 1.16,
``GRPOTrainer._generate_single_turn``) repeats each prompt ``num_generations`` times (its
RepeatSampler) and calls ``unwrapped_model.generate`` once on the whole batch with a
GenerationConfig of ``do_sample=True``, the temperature, top-p 1, top-k 0, ``disable_compile``;
it is rebuilt here as exactly that call, so both sides run the same transformers ``generate``
loop and the difference is what the engine adds or saves. Prompts: the smollm2-arithmetic
recipe's ("What is 23+48?" through the chat template), ``--prompts`` of them, each sampled
``--group`` times, ``--new-tokens`` at most. The two providers alternate, ``--repeats`` times
each; reported: median wall time, generated tokens (completion tokens up to and including EOS)
per second, and the ratio. The machine's load average is recorded with each run (on a shared
machine it is what the numbers depend on). Rows go to ``generation.jsonl`` and a table to
``generation.md`` in --out.

``--part step``: whole RL steps of sage-train against TRL's GRPOTrainer, each in a fresh process,
parts timed, peak RSS (`benchmarks.rl_step`); rows to ``step.jsonl``, a table to ``step.md``.

``--part update``: sage-train's update with its micro-batches padded against packed
(``padding_free``), at the demo's and the SmolLM2 recipe's settings (``--settings``), each in a
fresh process: tokens/s, peak memory, the padding fraction (`benchmarks.packed_update`); rows to
``update.jsonl``, a table to ``update.md``. The LM-head loss alone is ``sage-bench loss``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from . import packed_update
from .measure import machine

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sage-bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("generation", "step", "update"), default="generation")
    parser.add_argument("--settings", default="demo,smollm2", help="--part update: demo and/or smollm2 (default both)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a named model, GGUF file or HF directory")
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts (default 8)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (default 8: 64 rows)")
    parser.add_argument("--new-tokens", type=int, default=64, help="max new tokens (default 64)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per provider (default 2)")
    parser.add_argument(
        "--steps", type=int, default=2, help="--part step: RL steps per run, the last timed (default 2)"
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="--part step: activation checkpointing of the decoder layers on both sides (TRL's default)",
    )
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results"), help="output directory")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.settings.split(",")) - set(packed_update.SETTINGS))
    if unknown:
        parser.error(f"--settings: unknown {unknown}; known: {sorted(packed_update.SETTINGS)}")
    for key in ("prompts", "group", "new_tokens", "threads", "repeats", "steps"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    return args


def recipe_prompts(tokenizer, count: int) -> list[str]:
    """The smollm2-arithmetic recipe's held-out prompts, through the model's chat template."""
    from sage_train.tasks import get_task
    from sage_train.tasks.chat import ChatPromptTask

    task = ChatPromptTask(get_task("arithmetic", template="question"), tokenizer, "", "tokenizer")
    return [task.prompt(p) for p in task.problems("test", count, 0)]


def sage_engine(model, tokenizer, prompts, args, dtype=None) -> int:
    """One hf-engine generate of every prompt x group (sampling in `dtype`, None: the model's);
    returns the generated tokens."""
    from sage_train.rollout import SamplingParams, make_engine

    engine = make_engine("hf", model, tokenizer, device="cpu", dtype=dtype)
    params = SamplingParams(n=args.group, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    return sum(len(c.completion_ids) for group in engine.generate(prompts, params) for c in group)


def trl_generate(model, tokenizer, prompts, args) -> int:
    """TRL's non-vLLM generation (module docstring); returns the generated tokens."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=args.new_tokens,
        do_sample=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        cache_implementation=None,
    )
    repeated = [p for p in prompts for _ in range(args.group)]
    encoded = tokenizer(repeated, padding=True, return_tensors="pt", add_special_tokens=False)  # left: load_pretrained
    with torch.no_grad():
        out = model.generate(**encoded, generation_config=config, disable_compile=True)
    return completion_tokens(out[:, encoded["input_ids"].shape[1] :], tokenizer.eos_token_id)


def bf16_logprob_gap(model, tokenizer, prompts, args) -> dict:
    """How far the bfloat16 engine's log-probs of its sampled tokens are from the float32 model's
    (the trainer's scoring, `sage_train.policy.score`): mean and max |difference| over tokens, and
    the mean difference (the bias a truncated importance weight corrects, ``tis_level``)."""
    from sage_train.policy import PolicyHead, make_batch, score
    from sage_train.rollout import SamplingParams, make_engine

    engine = make_engine("hf", model, tokenizer, device="cpu", dtype=torch.bfloat16)
    params = SamplingParams(n=args.group, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    completions = [c for group in engine.generate(prompts, params) for c in group]
    batch = make_batch(completions, torch.device("cpu"), tokenizer.pad_token_id)
    with torch.no_grad():
        trainer_logp, _ = score(PolicyHead(model), batch, micro_batches=16, temperature=1.0)
    engine_logp = torch.zeros_like(trainer_logp)
    for row, c in enumerate(completions):
        engine_logp[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
    gap = (trainer_logp - engine_logp)[batch.completion_mask]
    return {
        "tokens": gap.numel(),
        "abs_mean": gap.abs().mean().item(),
        "abs_max": gap.abs().max().item(),
        "mean": gap.mean().item(),
    }


def completion_tokens(completions: torch.Tensor, eos: int) -> int:
    """Tokens of the rows of `completions` up to and including the first EOS (all of a row without
    one), as the engine counts them: ``generate`` pads finished rows, with EOS when it is the pad."""
    is_eos = completions == eos
    return int(torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, completions.shape[1]).sum())


PROVIDERS = {
    "sage hf engine": sage_engine,
    "sage hf engine, bf16": functools.partial(sage_engine, dtype=torch.bfloat16),
    "TRL generate": trl_generate,
}


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.part == "step":
        return whole_steps(args)
    if args.part == "update":
        return packed_updates(args)
    torch.set_num_threads(args.threads)
    from sage_train.models.loading import load_pretrained

    model, tokenizer = load_pretrained(args.model)
    model.eval()
    prompts = recipe_prompts(tokenizer, args.prompts)
    rows = []
    for repeat in range(args.repeats):
        for name, run in PROVIDERS.items():
            load = os.getloadavg()[0]
            torch.manual_seed(repeat)
            start = time.perf_counter()
            tokens = run(model, tokenizer, prompts, args)
            seconds = time.perf_counter() - start
            row = {"provider": name, "repeat": repeat, "seconds": seconds, "tokens": tokens, "load_before": load}
            row["tokens_per_s"] = tokens / seconds
            rows.append(row)
            print(json.dumps(row), flush=True)
    gap = bf16_logprob_gap(model, tokenizer, prompts, args)
    table = generation_table(rows) + (
        f"\nbf16 engine vs the float32 trainer's log-probs of the same {gap['tokens']} sampled tokens: "
        f"|diff| mean {gap['abs_mean']:.4f}, max {gap['abs_max']:.3f}; mean diff {gap['mean']:+.4f}\n"
    )
    write_results(args, "generation", rows, table, bf16_logprob_gap=gap)
    print(table)
    return 0


def write_results(args, stem: str, rows: list[dict], table: str, **info) -> None:
    """`rows` to ``<stem>.jsonl`` in --out, after a line of the machine, the arguments and `info`;
    `table` to ``<stem>.md``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = {"machine": machine("cpu"), "args": vars(args), **info}
    with open(out / f"{stem}.jsonl", "w") as f:
        f.write(json.dumps(head) + "\n" + "".join(json.dumps(r) + "\n" for r in rows))
    (out / f"{stem}.md").write_text(table)


def whole_steps(args) -> int:
    """``--part step`` (`benchmarks.rl_step`): rows to ``step.jsonl``, the table to ``step.md``."""
    from . import rl_step

    rows = rl_step.main(args)
    failed = [r for r in rows if "failed" in r]
    table = rl_step.step_table(rows) if len(failed) < len(rows) else ""
    write_results(args, "step", rows, table)
    print(table + "".join(f"{r['side']} failed:\n{r['failed']}\n" for r in failed))
    return 1 if failed else 0


def packed_updates(args) -> int:
    """``--part update`` (`benchmarks.packed_update`): rows to ``update.jsonl``, the table to ``update.md``."""
    rows = packed_update.main(args, args.settings.split(","))
    failed = [r for r in rows if "failed" in r]
    table = packed_update.update_table(rows)
    write_results(args, "update", rows, table)
    print(table + "".join(f"{r['setting']}, {r['layout']} failed:\n{r['failed']}\n" for r in failed))
    return 1 if failed else 0


def generation_table(rows: list[dict]) -> str:
    """Median seconds and tokens/s per provider, and each one's throughput over TRL's."""
    median = {name: statistics.median(r["tokens_per_s"] for r in rows if r["provider"] == name) for name in PROVIDERS}
    lines = ["| provider | median s | median tokens/s | x TRL | load (1-min) |", "|---|---|---|---|---|"]
    for name in PROVIDERS:
        mine = [r for r in rows if r["provider"] == name]
        seconds = statistics.median(r["seconds"] for r in mine)
        loads = ", ".join(f"{r['load_before']:.1f}" for r in mine)
        ratio = median[name] / median["TRL generate"]
        lines.append(f"| {name} | {seconds:.1f} | {median[name]:.1f} | {ratio:.2f} | {loads} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
