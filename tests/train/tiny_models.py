"""The one builder of the small Qwen2-style models the trainer tests use (fast on one CPU thread), and
of the `RunContext` a test's step runs them in."""

import torch

from sage_train.context import RunContext
from sage_train.models.loading import build_tiny_model
from sage_train.presets import loss_config


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
    """The `RunContext` of a test's own parts; its loss options built from `cfg` as `build_context` builds them."""
    return RunContext(
        cfg,
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
        loss=loss_config(cfg),
        **state,
    )
