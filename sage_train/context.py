"""A run's context, types only: what its steps and evaluations read (`RunContext`, built once by
`sage_train.build.build_context`: the run's settings, the warm-started policy and its reference in their
engines, the rollout engine, the prompted task, the guide), and the state that the steps carry from one
to the next (the current generation, the stop reason). The run's settings are frozen records
(`sage_train.records`), each beside the table or code it chooses from; `Settings` holds them all,
with the two that belong to no other module: the run's own keys (`RunSettings`) and the RL step's shape
(`StepSettings`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sage_kernels import LossConfig
from sage_kernels.guides import Guide

from .checkpoint import CheckpointSettings
from .eval.evaluate import EvalSettings
from .guide import GuideSettings
from .models.loading import ModelSettings
from .models.lora import LoraSettings
from .optim import OptimSettings
from .policy import Batch
from .report import LogSettings
from .rl_maths import Corrections, RewardSettings
from .rollout.base import RolloutEngine, RolloutSettings
from .sft import SftSettings
from .tasks.base import Problem, Task
from .tasks.chat import ChatSettings

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class RunSettings:
    """The run's own keys: where it lives, what it trains and for how many steps, how it starts."""

    name: str
    run_dir: Path
    seed: int
    steps: int
    algorithm: str
    guide: str  # the guide by name: none, or one of `sage_kernels.guides.GUIDES` (`guide.make_guide`)
    task: str
    model: str
    overwrite: bool
    resume: bool
    cpu_threads: int


@dataclass(frozen=True)
class StepSettings:
    """The RL step's shape (`sage_train.step`): its prompts and their groups, the generations and
    updates they feed, its micro-batches (rows or a token budget; packed or padded), DAPO's batch
    shaping, what it logs, and the temperature of the distribution it scores."""

    seed: int
    steps: int
    prompts_per_step: int
    group_size: int
    steps_per_generation: int
    num_iterations: int
    micro_batch_size: int
    max_tokens_per_micro_batch: int
    padding_free: bool | None
    max_nonfinite_steps: int
    dynamic_sampling: bool
    dynamic_sampling_max_rounds: int
    overlong_filter: bool
    log_completions: int
    temperature: float


@dataclass(frozen=True)
class Settings:
    """Every settings record of a run (`inputs.run_settings`), each read by the part of the run it names."""

    run: RunSettings
    step: StepSettings
    rollout: RolloutSettings
    corrections: Corrections
    reward: RewardSettings
    optim: OptimSettings
    evaluation: EvalSettings
    logging: LogSettings
    checkpoints: CheckpointSettings
    model: ModelSettings
    lora: LoraSettings
    sft: SftSettings
    chat: ChatSettings
    guide: GuideSettings
    loss: LossConfig  # the loss's own record (`presets.loss_config`); each step sets its normaliser
    #: every key of the run as saved in its config.yaml: data for the checkpoints and the loggers, not options to read
    saved: dict


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

    settings: Settings
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
