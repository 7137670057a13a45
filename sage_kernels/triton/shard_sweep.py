"""The triton backend's shard sweep: one vocabulary shard's (lse, logp, entropy), differentiable, for
the vocabulary-parallel head (`shard_sweep.FusedShardSweep` over the two-pass sweeps)."""

from __future__ import annotations

import torch

from ..shard_sweep import FusedShardSweep
from ..spec import logit_map
from .sweep_bwd import sweep_backward
from .sweep_fwd import sweep_forward
from .tiles import check_device


def shard_stats(hidden2d, weight, bias, token_ids, temperature: float):
    """(lse, logp, entropy) [n] over one vocabulary shard (`backends.Backend`), float32."""
    return FusedShardSweep.apply(hidden2d, weight, bias, token_ids, float(temperature), _ShardSweep)


class _ShardSweep:
    """The two-pass sweeps (`sweep_fwd.sweep_forward`, `sweep_bwd.sweep_backward`) over every row of
    one vocabulary shard."""

    def __init__(self, hidden2d, weight, bias, token_ids, temperature):
        check_device(hidden2d)
        n, device = hidden2d.shape[0], hidden2d.device
        self.hidden, self.weight, self.bias = hidden2d.contiguous(), weight.contiguous(), bias
        self.token_ids, self.logits = token_ids, logit_map(temperature)
        self.rows = torch.arange(n, device=device)
        self.count = torch.full((), n, dtype=torch.int64, device=device)

    def forward(self):
        self.stats = sweep_forward(
            self.hidden, self.weight, self.bias, self.token_ids, self.rows, self.count, self.logits
        )
        return tuple(t.clone() for t in self.stats)

    def backward(self, g, c, need_hidden, need_weight, need_bias):
        lse, _, entropy = self.stats
        return sweep_backward(
            torch.ones((), dtype=torch.float32, device=self.hidden.device),
            self.hidden,
            self.weight,
            self.bias,
            self.token_ids,
            self.rows,
            self.count,
            lse,
            entropy,
            g,
            c,
            self.logits,
            True,
            need_weight=need_weight,
            need_bias=need_bias,
            need_hidden=need_hidden,
            rows_are_identity=True,
        )
