"""A run's context, types only: what its steps and evaluations read (`RunContext`, built once by
`sage_train.build.build_context`: the warm-started policy and its reference in their engines, the
rollout engine, the prompted task, the guide), and the state that the steps carry from one to the
next (the current generation, the stop reason)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sage_kernels import LossConfig
from sage_kernels.guides import Guide

from .config import TrainConfig
from .policy import Batch
from .rollout.base import RolloutEngine
from .tasks.base import Problem, Task

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase


@dataclass
class Generation:
    """One generation of rollouts, scored once, that feeds ``steps_per_generation`` optimizer steps.

    Its rows are shuffled and dealt out in equal parts, one per step; the behaviour and reference
    log-probs are those at generation time, so every step after the first is off-policy by the
    updates before it, and the clipped ratio is active there (TRL's ``steps_per_generation``)."""

    first_step: int
    batch: Batch
    advantages: torch.Tensor
    old_logp: torch.Tensor
    ref_logp: torch.Tensor | None
    is_weights: torch.Tensor | None
    order: torch.Tensor  # the shuffled rows; step first_step + i takes its i-th part
    metrics: dict  # the rollouts' metrics, logged with each of its steps
    timing: dict  # seconds spent sampling + grading and scoring it, logged with the step that made it


@dataclass
class RunContext:
    """What the run's steps and evaluations read (built once by `sage_train.build.build_context`), and the state the
    steps carry."""

    cfg: TrainConfig
    engine: DeepSpeedEngine  # wraps PolicyHead(policy)
    reference: Callable | None  # PolicyHead(frozen reference), the adapter-disabled engine, or None
    rollout: RolloutEngine
    tokenizer: PreTrainedTokenizerBase
    task: Task  # in the run's prompt format (`chat_prompted`)
    train_problems: list[Problem]
    guide: Guide | None  # `make_guide`'s; None for ``guide: none``
    rank: int
    world: int
    device: torch.device
    #: the run's loss options (`presets.loss_config`), built once; each step sets its normaliser
    loss: LossConfig = field(kw_only=True)
    generation: Generation | None = None  # the rollouts the current optimizer steps learn from
    nonfinite_in_a_row: int = 0  # RL steps in a row with a skipped optimizer step
    stop: str = ""  # why the run must stop (set by `step.check_finite_steps`)
    padding_free: bool = False  # micro-batches packed into one row each (`sage_train.micro_batches`)
    #: split -> (prompted task, problems) that `run.evaluate_once` samples (`inputs.evaluation_sets`)
    evaluations: dict[str, tuple[Task, list[Problem]]] = field(default_factory=dict)
