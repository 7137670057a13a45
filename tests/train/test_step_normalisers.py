"""The step's loss normalisers against TRL 1.16's `GRPOTrainer._compute_loss`, written out.

The trainer's step is TRL's local batch with no gradient accumulation (docs/recipes.md: the
official runs use per-device batch 8, accumulation 1). Each micro-batch's loss is the oracle's
`aggregate` under the step's config times `row_share`; a rank's step loss is their sum and the
ranks' losses add up (the backward's world-size factor undoes DeepSpeed's averaging)."""

import pytest
import torch
from tiny_models import step_context

from sage_kernels.reference import aggregate
from sage_train.policy import Batch
from sage_train.step import step_loss_config


def rank_batch(mask: torch.Tensor) -> Batch:
    B, L = mask.shape
    ids = torch.zeros(B, L + 1, dtype=torch.long)
    return Batch(ids, torch.ones_like(ids), ids, ids[:, 1:], mask, prompt_length=1)


def trainer_loss(cfg, world: int, masks: list, losses: list, micro: int) -> torch.Tensor:
    """The loss of one optimizer step, summed over the `world` ranks (rank r holds masks[r])."""
    total = torch.zeros((), dtype=torch.float64)
    for mask, loss in zip(masks, losses):
        batch = rank_batch(mask)
        ctx = step_context(cfg, world=world)
        config, row_share = step_loss_config(ctx, batch)
        for start in range(0, batch.rows, micro):
            rows = slice(start, start + micro)
            total = total + aggregate(loss[rows], mask[rows].double(), config) * row_share(len(mask[rows]))
    return total


def trl_loss(loss_type: str, masks: list, losses: list) -> torch.Tensor:
    """TRL's aggregation, each process's local batch being its whole step; DDP averages processes."""
    per_process = []
    for mask, loss in zip(masks, losses):
        m = mask.double()
        if loss_type == "bnpo":
            per_process.append((loss * m).sum() / m.sum().clamp(min=1.0))
        elif loss_type == "grpo":
            per_process.append(((loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean())
        else:  # dapo: num_items_in_batch, the global token count, over the number of processes
            count = sum(x.sum() for x in masks).double() / len(masks)
            per_process.append((loss * m).sum() / count)
    return torch.stack(per_process).mean()


def step_inputs(world: int):
    """Per-rank masks with different token counts (and a fully masked row), per-token losses."""
    g = torch.Generator().manual_seed(0)
    masks, losses = [], []
    for rank in range(world):
        lengths = torch.tensor([6, 1, 0, 3] if rank == 0 else [2, 2, 1, 2])
        masks.append(torch.arange(6)[None, :] < lengths[:, None])
        losses.append(torch.randn(4, 6, generator=g, dtype=torch.float64))
    return masks, losses


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo", "grpo"])
@pytest.mark.parametrize("micro", [1, 3, 4])
def test_one_rank_matches_trl(tiny_config, loss_type, micro):
    cfg = tiny_config(loss_type=loss_type, prompts_per_step=1, group_size=4, micro_batch_size=micro)
    masks, losses = step_inputs(1)
    expected = trl_loss(loss_type, masks, losses)
    torch.testing.assert_close(trainer_loss(cfg, 1, masks, losses, micro), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("loss_type", ["bnpo", "grpo"])
def test_bnpo_over_two_ranks_averages_their_local_means_as_trl(tiny_config, loss_type):
    """bnpo over ranks is TRL's mean of each process's token mean, not dapo's global token mean
    (the trainer used to give bnpo dapo's all-reduced count, making the two the same loss)."""
    cfg = tiny_config(loss_type=loss_type, prompts_per_step=2, group_size=4, micro_batch_size=2)
    masks, losses = step_inputs(2)
    got = trainer_loss(cfg, 2, masks, losses, micro=2)
    torch.testing.assert_close(got, trl_loss(loss_type, masks, losses), rtol=1e-12, atol=0)
    if loss_type == "bnpo":
        global_token_mean = sum((x * m.double()).sum() for x, m in zip(losses, masks)) / sum(m.sum() for m in masks)
        assert abs(got - global_token_mean) > 1e-3
