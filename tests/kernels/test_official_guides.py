"""The token and random guides against the official SAGE formulas, restated here independently.

`official_*` below are written from the published description (a Python loop over rows with
torch.quantile, as plain as possible), not from `sage_kernels.guides`; the guides must match them
exactly where they are deterministic (the weights w, the schedule) and in distribution where they
draw noise (q's mean, std, fractions above / below 1, q on the most surprising tokens), on large
random inputs, along the schedule.
"""

import math

import pytest
import torch

from sage_kernels.guides import CosineAnnealingScheduler, RandomGuide, TokenGuide, surprisal_weights

MAX_STEPS = 1000


def official_schedule_value(step: int, ub: float, lb: float, *, max_steps=MAX_STEPS, cycles=8, decay=0.9):
    """The value read before the optimizer step `step` (0-based): the upper bound decays once per
    finished cycle, at most cycles - 1 times; within a cycle a half cosine from ub to lb."""
    length = max(1, max_steps // cycles)
    upper = ub * decay ** min(step // length, cycles - 1)
    t = (step % length) / length
    return lb + (upper - lb) * 0.5 * (1 + math.cos(math.pi * t))


def official_weights(surprisal: torch.Tensor, mask: torch.Tensor, norm: str) -> torch.Tensor:
    w = torch.zeros_like(surprisal)
    for row in range(surprisal.shape[0]):
        valid = mask[row]
        if not valid.any():
            continue
        s = surprisal[row, valid]
        if norm == "minmax":
            s = s.clamp(torch.quantile(s, 0.05), torch.quantile(s, 0.95))
            w[row, valid] = (s - s.min()) / max(float(s.max() - s.min()), 1e-6)
        elif norm == "rank":
            ranks = torch.tensor([sum(1 for x in s.tolist() if x < v) for v in s.tolist()], dtype=s.dtype)
            w[row, valid] = ranks / max(1, len(s) - 1)
        else:
            z = (s - s.mean()) / max(float(s.std(unbiased=False)), 1e-6)
            w[row, valid] = torch.sigmoid(z)
    return w.clamp(0, 1)


def official_token_q(logp, mask, step, generator, norm="minmax"):
    alpha = official_schedule_value(step, 0.3, 0.1)
    sigma = official_schedule_value(step, 0.25, 0.1)
    w = official_weights(-logp, mask, norm)
    xi = torch.randn(logp.shape, generator=generator, dtype=logp.dtype)
    q = (1 + alpha * w + sigma * w * xi).clamp(0.6, 1.4)
    return torch.where(mask, q, 1.0)


def official_random_q(mask, step, generator):
    eps = official_schedule_value(step, 0.1, 0.0)
    sigma = official_schedule_value(step, 0.15, 0.05)
    u = torch.rand(mask.shape, generator=generator, dtype=torch.float64)
    xi = torch.randn(mask.shape, generator=generator, dtype=torch.float64)
    q = torch.where(u < eps, 1 + sigma * xi, 1.0).clamp(0.6, 1.4)
    return torch.where(mask, q, 1.0)


def policy_like_inputs(rows=256, length=400, seed=0):
    """Log-probs shaped like a sampling policy's (most tokens near-certain, a heavy tail of
    surprising ones) and right-padded masks of varied lengths, a few rows empty or of one token."""
    g = torch.Generator().manual_seed(seed)
    confident = torch.rand(rows, length, generator=g, dtype=torch.float64) < 0.7
    surprisal = torch.where(
        confident,
        torch.rand(rows, length, generator=g, dtype=torch.float64) * 0.05,
        -torch.rand(rows, length, generator=g, dtype=torch.float64).log() / 0.7,
    )
    lengths = torch.randint(0, length + 1, (rows,), generator=g)
    lengths[:3] = torch.tensor([0, 1, 2])
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return -surprisal, mask


def stats(q: torch.Tensor, mask: torch.Tensor, top: torch.Tensor) -> dict:
    values = q[mask].double()
    return {
        "mean": values.mean().item(),
        "std": values.std().item(),
        "above": (values > 1.01).double().mean().item(),
        "below": (values < 0.99).double().mean().item(),
        "top_mean": q[top].double().mean().item(),
    }


def most_surprising(logp, mask):
    """Each row's tokens at or above its own 95% surprisal quantile."""
    top = torch.zeros_like(mask)
    for row in range(mask.shape[0]):
        if mask[row].sum() > 1:
            s = -logp[row, mask[row]]
            top[row, : len(s)] = s >= torch.quantile(s, 0.95)
    return top


@pytest.mark.parametrize(
    "step,alpha,sigma",
    [
        (0, 0.30, 0.25),
        (62, 0.201, 0.176),
        (124, 0.100, 0.100),
        (125, 0.270, 0.225),
        (250, 0.243, 0.2025),
        (500, 0.197, 0.164),
        (875, 0.1435, 0.1196),
        (999, 0.100, 0.100),
    ],
)
def test_token_schedule_reference_points(step, alpha, sigma):
    guide = TokenGuide(max_steps=MAX_STEPS)
    for _ in range(step):
        guide.step()
    a, s = guide.schedule.value()
    assert a == pytest.approx(alpha, abs=5e-4) and s == pytest.approx(sigma, abs=5e-4)


def test_schedule_matches_the_closed_form_at_every_step():
    scheduler = CosineAnnealingScheduler(MAX_STEPS, 0.1, 0.0, 0.15, 0.05)  # the random guide's bounds
    for step in range(MAX_STEPS + 130):  # past the end: the last cycle's bounds stay
        eps, sigma = scheduler.value()
        assert eps == pytest.approx(official_schedule_value(step, 0.1, 0.0), abs=1e-12)
        assert sigma == pytest.approx(official_schedule_value(step, 0.15, 0.05), abs=1e-12)
        scheduler.step()
    short = CosineAnnealingScheduler(5, 1.0, 0.0, 1.0, 0.0)  # fewer steps than cycles: cycles of one step
    assert short.cycle_length == 1 and short.value() == (1.0, 1.0)


@pytest.mark.parametrize("norm", ["minmax", "rank", "zscore"])
def test_surprisal_weights_equal_the_official_ones(norm):
    logp, mask = policy_like_inputs(rows=64, length=120, seed=1)
    expected = official_weights(-logp, mask, norm)
    got = surprisal_weights(-logp, mask, norm)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)  # float32 vs float64
    assert (got[~mask] == 0).all() and got[0].abs().sum() == 0  # masked, and the empty row


@pytest.mark.parametrize("step", [0, 62, 125, 500, 999])
def test_token_guide_reproduces_the_official_distribution(step):
    logp, mask = policy_like_inputs(seed=2)
    top = most_surprising(logp, mask)
    guide = TokenGuide(max_steps=MAX_STEPS, seed=3)
    guide.schedule.load_state_dict(_position(step, 0.3, 0.25))
    q = guide.log_q(logp.float(), torch.zeros_like(logp), mask).exp().double()
    assert (q[~mask] == 1).all()
    got = stats(q, mask, top)
    want = stats(official_token_q(logp, mask, step, torch.Generator().manual_seed(4)), mask, top)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=0.01), (key, got, want)
    if step == 0:  # the strong start: mean q well above 1, yet some surprising tokens below it
        assert want["mean"] > 1.02 and want["below"] > 0.01


@pytest.mark.parametrize("step", [0, 62, 125, 500, 999])
def test_random_guide_reproduces_the_official_distribution(step):
    _, mask = policy_like_inputs(seed=5)
    guide = RandomGuide(max_steps=MAX_STEPS, seed=6)
    guide.schedule.load_state_dict(_position(step, 0.1, 0.15))
    q = guide.log_q(None, None, mask).exp().double()  # it reads neither log-probs nor entropies
    assert (q[~mask] == 1).all()
    got = stats(q, mask, mask)
    want = stats(official_random_q(mask, step, torch.Generator().manual_seed(7)), mask, mask)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=0.01), (key, got, want)
    eps = official_schedule_value(step, 0.1, 0.0)
    changed = (q[mask] != 1).double().mean().item()
    assert changed == pytest.approx(eps, abs=0.005)  # only an eps share of tokens is perturbed


def test_guides_resume_the_same_stream():
    logp, mask = policy_like_inputs(rows=8, length=30, seed=8)
    for make, call in (
        (lambda s: TokenGuide(max_steps=40, seed=s), lambda g: g.log_q(logp, None, mask)),
        (lambda s: RandomGuide(max_steps=40, seed=s), lambda g: g.log_q(None, None, mask)),
    ):
        a = make(1)
        for _ in range(7):
            call(a), a.step()
        state = a.state_dict()
        expected = [call(a) for _ in range(2)]
        b = make(99)
        b.load_state_dict(state)
        assert all(torch.equal(call(b), e) for e in expected)


def test_bad_options_name_themselves():
    with pytest.raises(ValueError, match="normalization"):
        TokenGuide(max_steps=10, normalization="softmax")
    with pytest.raises(ValueError, match="max_steps"):
        RandomGuide(max_steps=0)
    with pytest.raises(ValueError, match="decay_rate"):
        CosineAnnealingScheduler(10, 1, 0, 1, 0, decay_rate=0)


def _position(step: int, ub_a: float, ub_b: float) -> dict:
    """The schedule's state before optimizer step `step` (1000 steps, 8 cycles, decay 0.9)."""
    cycle = min(step // 125, 7)
    return {"count": step, "cycle": cycle, "ub_a": ub_a * 0.9**cycle, "ub_b": ub_b * 0.9**cycle}
