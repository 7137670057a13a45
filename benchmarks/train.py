"""`sage-bench train`: the RL step's parts on a real model, side by side with TRL's.

``--part generation`` (the one part so far): rollout throughput of the trainer's hf engine
(`sage_train.rollout.hf`: one generator per row, the prompt's KV cache computed once per group)
against the generation TRL's GRPOTrainer does without vLLM, on the same prompts and settings.
TRL's path (trl 1.16, ``GRPOTrainer._generate_single_turn``) repeats each prompt ``num_generations``
times (its RepeatSampler) and calls ``unwrapped_model.generate`` once on the whole batch with a
GenerationConfig of ``do_sample=True``, the temperature, top-p 1, top-k 0, ``disable_compile``;
it is rebuilt here as exactly that call, so both sides run the same transformers ``generate``
loop and the difference is what the engine adds or saves. Prompts: the smollm2-arithmetic
recipe's ("What is 23+48?" through the chat template), ``--prompts`` of them, each sampled
``--group`` times, ``--new-tokens`` at most. The two providers alternate, ``--repeats`` times
each; reported: median wall time, generated tokens (completion tokens up to and including EOS)
per second, and the ratio. The machine's load average is recorded with each run (on a shared
machine it is what the numbers depend on). Rows go to ``generation.jsonl`` and a table to
``generation.md`` in --out.

Not here yet: the whole RL step against TRL's GRPOTrainer (scoring, loss + backward, peak RSS);
the LM-head loss alone is ``sage-bench loss``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from .measure import machine

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sage-bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("generation",), default="generation")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a named model, GGUF file or HF directory")
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts (default 8)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (default 8: 64 rows)")
    parser.add_argument("--new-tokens", type=int, default=64, help="max new tokens (default 64)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per provider (default 2)")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results"), help="output directory")
    args = parser.parse_args(argv)
    for key in ("prompts", "group", "new_tokens", "threads", "repeats"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    return args


def recipe_prompts(tokenizer, count: int) -> list[str]:
    """The smollm2-arithmetic recipe's held-out prompts, through the model's chat template."""
    from sage_train.tasks import get_task
    from sage_train.tasks.chat import ChatPromptTask

    task = ChatPromptTask(get_task("arithmetic", template="question"), tokenizer, "", "tokenizer")
    return [task.prompt(p) for p in task.problems("test", count, 0)]


def sage_engine(model, tokenizer, prompts, args) -> int:
    """One hf-engine generate of every prompt x group; returns the generated tokens."""
    from sage_train.rollout import SamplingParams, make_engine

    engine = make_engine("hf", model, tokenizer, device="cpu")
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


def completion_tokens(completions: torch.Tensor, eos: int) -> int:
    """Tokens of the rows of `completions` up to and including the first EOS (all of a row without
    one), as the engine counts them: ``generate`` pads finished rows, with EOS when it is the pad."""
    is_eos = completions == eos
    return int(torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, completions.shape[1]).sum())


PROVIDERS = {"sage hf engine": sage_engine, "TRL generate": trl_generate}


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    from sage_train.model import load_pretrained

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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"machine": machine("cpu"), "args": vars(args)}
    with open(out / "generation.jsonl", "w") as f:
        f.write(json.dumps(info) + "\n" + "".join(json.dumps(r) + "\n" for r in rows))
    table = generation_table(rows)
    (out / "generation.md").write_text(table)
    print(table)
    return 0


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
