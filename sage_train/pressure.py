"""The anchor's per-token pressure: how hard a run's KL anchor (and the guide's share of it) pulls on
log pi against the task, measured in every run with a KL in its loss, so a guide's dose is read from
the run itself (`STEP_METRICS.anchor_pressure`, `STEP_METRICS.guide_pressure`)."""

from __future__ import annotations

import torch

from sage_kernels.reference import kl_estimate

from .step_metrics import STEP_METRICS


def pull_sums(out, inputs: dict, config) -> dict | None:
    """Sums over a micro-batch's tokens of each part of the loss's coefficient on log pi(token) (its
    gradient with respect to it), in absolute value: the task's |A| ratio, the anchor's beta |dKL/dlog
    pi| of the KL to q pi_ref (`config.kl`'s estimator; k3's is beta (1 - q pi_ref / pi)), and the
    guide's part of that, beta |dKL/dlog pi at q - at q = 1|. None without a KL in the loss (beta 0,
    or the KL in the reward)."""
    if config.beta == 0 or inputs["ref_logp"] is None:
        return None
    mask = inputs["mask"]  # [rows, L] padded, [N] packed: every per-token value is read in its shape
    advantages = inputs["advantages"].float()
    advantages = (advantages[:, None] if advantages.dim() < mask.dim() else advantages).expand(mask.shape)
    to_ref = inputs["ref_logp"].float().reshape(mask.shape) - out.logp.float().reshape(mask.shape)
    with torch.enable_grad():  # log pi_ref / pi with and without the guide's log q
        deltas = torch.stack([to_ref + out.q.float().reshape(mask.shape).log(), to_ref]).requires_grad_()
        (slopes,) = torch.autograd.grad(kl_estimate(deltas, config.kl).sum(), deltas)
    parts = {
        "task": advantages * out.ratio.float().reshape(mask.shape),
        "anchor": config.beta * slopes[0],  # d/dlog pi = -d/ddelta; the sign drops under |.|
        "guide": config.beta * (slopes[0] - slopes[1]),
    }
    return {name: torch.where(mask, part.abs(), 0.0).sum() for name, part in parts.items()}


def pressure_metrics(pull: dict | None) -> dict:
    """The anchor's and the guide's pull over the task's from summed `pull_sums` (NaN when no token had
    an advantage; nothing without a KL in the loss)."""
    if pull is None:
        return {}
    task = pull["task"]
    return {
        name: torch.where(task > 0, pull[part] / task.clamp(min=1e-30), torch.nan)
        for name, part in ((STEP_METRICS.anchor_pressure, "anchor"), (STEP_METRICS.guide_pressure, "guide"))
    }
