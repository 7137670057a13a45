"""Rollout engines behind one interface, with the table that names them (`base`: `RolloutEngine`,
`ENGINES`, `make_engine`)."""

from .base import ENGINES, Completion, RolloutEngine, SamplingParams, make_engine

__all__ = ["Completion", "RolloutEngine", "SamplingParams", "make_engine", "ENGINES"]
