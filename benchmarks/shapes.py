"""Problem shapes named after real LM heads, the default plans, and the benchmark inputs.

A point is (shape, N, dtype, mask fraction); every provider of a point sees the same
inputs, built here from a fixed seed. N = B * L tokens with L = min(N, 1024) (a typical
RL completion length); a masked fraction f keeps the first round(L * (1 - f)) tokens of
every row, as padding after a completion's end does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: (hidden size D, vocabulary V) of the LM heads the benchmark is named after.
SHAPES = {
    "cpu-small": (512, 32000),
    "smollm2-135m": (576, 49152),
    "qwen2.5-0.5b": (896, 151936),
    "qwen2.5-1.5b": (1536, 151936),
    "qwen2.5-7b": (3584, 152064),
    "llama-3-8b": (4096, 128256),
    "gemma-2-2b": (2304, 256000),
    "tiny": (64, 1000),  # for the harness's smoke test
}

#: Default plans: (shape, Ns, modes, mask fractions). The CPU plan fits the 10-minute budget of a
#: 2-core machine and holds both shapes of the CPU backend's targets; the CUDA plan (run by
#: run_device.sh, which stops starting rows near its time limit) begins with the Triton
#: kernels' target point.
DEFAULT_PLANS = {
    "cpu": [
        ("cpu-small", [2048], ["fwd", "fwd+bwd"], [0.0]),
        ("cpu-small", [2048], ["fwd+bwd"], [0.5]),
        ("qwen2.5-0.5b", [4096], ["fwd+bwd"], [0.0]),
    ],
    "cuda": [
        ("qwen2.5-7b", [16384], ["fwd+bwd", "fwd"], [0.0]),
        ("llama-3-8b", [16384, 32768], ["fwd+bwd"], [0.0]),
        ("qwen2.5-7b", [4096, 8192], ["fwd+bwd"], [0.0]),
        ("qwen2.5-7b", [16384], ["fwd+bwd"], [0.5]),
    ],
}

SEQ_LEN = 1024
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Point:
    """One benchmark configuration; all providers and modes of a point share its inputs."""

    shape: str
    n: int
    dtype: str
    mask_fraction: float
    device: str

    @property
    def d(self) -> int:
        return SHAPES[self.shape][0]

    @property
    def v(self) -> int:
        return SHAPES[self.shape][1]

    @property
    def seq_len(self) -> int:
        return min(self.n, SEQ_LEN)


@dataclass
class Inputs:
    """The loss inputs of a point: hidden [B, L, D], weight [V, D], per-token tensors [B, L]."""

    hidden: torch.Tensor
    weight: torch.Tensor
    token_ids: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logp: torch.Tensor
    ref_logp: torch.Tensor

    def rows(self, count: int) -> Inputs:
        """The first `count` rows (completions): the slice used for the float64 error."""
        return Inputs(
            self.hidden[:count],
            self.weight,
            *(t[:count] for t in (self.token_ids, self.mask, self.advantages, self.old_logp, self.ref_logp)),
        )

    def to(self, dtype: torch.dtype) -> Inputs:
        """A detached copy with hidden and weight in `dtype` (per-token tensors unchanged)."""
        return Inputs(
            self.hidden.detach().to(dtype),
            self.weight.detach().to(dtype),
            self.token_ids,
            self.mask,
            self.advantages,
            self.old_logp,
            self.ref_logp,
        )


def check_point(point: Point) -> None:
    if point.shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {point.shape!r}")
    if point.n % point.seq_len:
        raise ValueError(f"N must be a multiple of {SEQ_LEN} when N > {SEQ_LEN}, got {point.n}")
    if not 0.0 <= point.mask_fraction < 1.0:
        raise ValueError(f"mask fraction must be in [0, 1), got {point.mask_fraction}")
    if point.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {point.dtype!r}")


def make_inputs(point: Point, seed: int = 0) -> Inputs:
    """Random inputs whose logits have a realistic spread (std 3, entropies of a few nats).

    old_logp and ref_logp are the policy's own log-probs plus small noise, so ratios sit near
    1 and both sides of the clip range are exercised, as in a real update.
    """
    check_point(point)
    device, dtype = torch.device(point.device), DTYPES[point.dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    B, L, D, V = point.n // point.seq_len, point.seq_len, point.d, point.v
    hidden = torch.randn(B, L, D, generator=gen, device=device).to(dtype)
    weight = (torch.randn(V, D, generator=gen, device=device) * (3.0 / D**0.5)).to(dtype)
    token_ids = torch.randint(0, V, (B, L), generator=gen, device=device)
    kept = round(L * (1.0 - point.mask_fraction))
    mask = (torch.arange(L, device=device) < kept).expand(B, L).contiguous()
    advantages = torch.randn(B, generator=gen, device=device)
    logp = policy_logp(hidden.reshape(B * L, D), weight, token_ids.reshape(-1)).view(B, L)
    noise = torch.randn(2, B, L, generator=gen, device=device) * 0.1
    return Inputs(hidden, weight, token_ids, mask, advantages, logp + noise[0], logp + noise[1])


@torch.no_grad()
def policy_logp(
    hidden2d: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor, chunk: int = 1024
) -> torch.Tensor:
    """log softmax(h W^T)[y] in float32, a chunk of tokens at a time (never [N, V] at once)."""
    out = torch.empty(hidden2d.shape[0], dtype=torch.float32, device=hidden2d.device)
    for start in range(0, hidden2d.shape[0], chunk):
        z = (hidden2d[start : start + chunk] @ weight.t()).float()
        ids = token_ids[start : start + chunk, None]
        out[start : start + chunk] = (z.gather(1, ids) - z.logsumexp(-1, keepdim=True)).squeeze(1)
    return out
