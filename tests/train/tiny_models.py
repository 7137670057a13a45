"""The one builder of the small Qwen2-style models the trainer tests use (fast on one CPU thread), of
the `RunContext` a test's step runs them in, and of ragged completions for them to score (`completions`)."""

import random

import torch

from sage_train.context import RunContext
from sage_train.inputs import run_settings
from sage_train.models.loading import build_tiny_model
from sage_train.rollout import Completion


def tiny_model(tokenizer, seed=0, max_positions=128, layers=2, hidden=32, heads=2, kv_heads=1):
    return build_tiny_model(
        tokenizer,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=2 * hidden,
        max_positions=max_positions,
        seed=seed,
    )


def step_context(
    cfg,
    engine=None,
    reference=None,
    *,
    rollout=None,
    tokenizer=None,
    task=None,
    problems=(),
    guide=None,
    rank=0,
    world=1,
    device=torch.device("cpu"),
    **state,
) -> RunContext:
    """The `RunContext` of a test's own parts: the settings records of `cfg` (`run_settings`), its loss options
    their `Settings.loss`, as `build_context` takes them."""
    settings = run_settings(cfg)
    return RunContext(
        settings,
        engine,
        reference,
        rollout,
        tokenizer,
        task,
        list(problems),
        guide,
        rank,
        world,
        device,
        loss=settings.loss,
        **state,
    )


def completions(tokenizer, rows: int, seed: int) -> list:
    """`rows` completions of random tokens (prompts of 2-6, completions of 1-7 then EOS), 4 per prompt."""
    rng = random.Random(seed)
    vocab = list(range(3, len(tokenizer)))
    out = []
    for row in range(rows):
        prompt = [rng.choice(vocab) for _ in range(rng.randint(2, 6))]
        completion = [rng.choice(vocab) for _ in range(rng.randint(1, 7))] + [tokenizer.eos_token_id]
        out.append(Completion(prompt_index=row // 4, prompt_ids=prompt, completion_ids=completion, text=""))
    return out
