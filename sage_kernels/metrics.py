"""The loss's metrics as one table: their names, how each reduces, and the fused token stage's columns.

Every metric reduces one per-token value over the unmasked tokens of a call: a mean, a min or a max
(`Metric`). The reference computes them from this table (`reduce_masked`); the Triton token stage
writes one row of partial results per sequence, [B, len(ROW_STATS)] (the row's share of the loss,
then per metric the row's sum, min or max), whose columns it addresses through `COLUMNS`, and
`metrics_vector` reduces those rows to the metrics in `METRIC_NAMES` order. A caller that averages
metrics over micro-batches weights the token means (`MEAN_METRICS`) by their token counts and takes
the min and max of the others (`EXTREME_METRICS`), over ranks as over micro-batches; a caller names
one metric through `METRIC_NAME` (``METRIC_NAME.q_max``), never by spelling it. A new metric is a row
here and its per-token value in the reference and the kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .ordered import ordered_sum


class Metric(NamedTuple):
    """One metric: its logged `name` (TRL's and the official SAGE code's), the fused token stage's
    `column` for it, the per-token `value` it reduces (the reference's name for it) and its
    `reduction` over the unmasked tokens: "mean", "min" or "max"."""

    name: str
    column: str
    value: str
    reduction: str


METRICS = (
    Metric("kl", "kl", "kl", "mean"),
    Metric("entropy", "entropy", "entropy", "mean"),
    Metric("sage/q_mean", "q", "q", "mean"),
    Metric("sage/q_min", "q_min", "q", "min"),
    Metric("sage/q_max", "q_max", "q", "max"),
    Metric("clip_ratio/low_mean", "low", "low", "mean"),
    Metric("clip_ratio/high_mean", "high", "high", "mean"),
    Metric("clip_ratio/region_mean", "region", "region", "mean"),
)
#: the names of `SageLossOutput.metrics`, in the order of the fused backends' metric vector.
METRIC_NAMES = tuple(metric.name for metric in METRICS)
#: the metrics that are means over tokens (the others are a min and a max).
MEAN_METRICS = tuple(metric.name for metric in METRICS if metric.reduction == "mean")
#: the others, a min or a max over tokens, micro-batches and ranks alike: {name: "min" or "max"}.
EXTREME_METRICS = {metric.name: metric.reduction for metric in METRICS if metric.reduction != "mean"}
#: each metric's name by its column (``METRIC_NAME.q_min == "sage/q_min"``): how a caller names one.
METRIC_NAME = NamedTuple("MetricNames", [(metric.column, str) for metric in METRICS])(*METRIC_NAMES)
#: the columns of the fused token stage's per-row partial results: the row's share of the loss, then
#: one per metric.
ROW_STATS = ("loss",) + tuple(metric.column for metric in METRICS)
RowColumns = NamedTuple("RowColumns", [(column, int) for column in ROW_STATS])
#: each column's index, as the kernel takes them (a constexpr NamedTuple: ``COLUMNS.kl``).
COLUMNS = RowColumns(*range(len(ROW_STATS)))


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of `x` over the positions where `mask` is set (0 without any)."""
    m = mask.to(x.dtype)
    return ordered_sum(x * m) / ordered_sum(m).clamp(min=1.0)


def reduce_masked(x: torch.Tensor, mask: torch.Tensor, reduction: str) -> torch.Tensor:
    """`x` reduced over the unmasked positions by a `Metric.reduction` (min: +inf and max: -inf
    without any)."""
    if reduction == "mean":
        return masked_mean(x, mask)
    if reduction == "min":
        return torch.where(mask, x, float("inf")).min()
    return torch.where(mask, x, float("-inf")).max()


def metrics_vector(row_stats: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The metrics in `METRIC_NAMES` order, one vector, from the per-row partial results [B,
    len(ROW_STATS)]; NaN throughout when no position is unmasked (no value: the reference's
    convention)."""
    tokens = mask.sum().to(torch.float32)
    sums = row_stats.sum(0)
    values = []
    for metric in METRICS:
        column = getattr(COLUMNS, metric.column)
        if metric.reduction == "mean":
            values.append(sums[column] / tokens)
        elif metric.reduction == "min":
            values.append(row_stats[:, column].min())
        else:
            values.append(row_stats[:, column].max())
    return torch.where(tokens > 0, torch.stack(values), float("nan"))
