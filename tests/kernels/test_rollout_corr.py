"""`sage_kernels.rollout_corr` against verl 0.9.1's own ``compute_offpolicy_metrics``,
``compute_rollout_correction_weights`` and ``compute_is_metrics`` on the same inputs: every name
verl returns, each value equal (the installed verl in its side environment, else its wheel's code)."""

import math

import pytest
import torch
from verl_peer import rollout_corr_helper

from sage_kernels import rollout_corr


@pytest.fixture(scope="module")
def verl():
    return rollout_corr_helper()


def batch(seed, B=6, L=9, empty_row=False, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    train = torch.log(torch.rand(B, L, generator=g).clamp(0.01, 0.99))
    rollout = train + spread * torch.randn(B, L, generator=g)
    rollout[0] = train[0] + 0.01  # a row near the trainer
    rollout[2, :3] -= 1.5  # tokens far from it
    rollout[3] -= 3.0  # a row whose product of ratios passes e^20 (verl's safety bound)
    mask = torch.rand(B, L, generator=g) > 0.25
    mask[:, 0] = True
    mask[-1, 4:] = False
    if empty_row:
        mask[1] = False
    return train, rollout, mask


def assert_same(ours: dict, want: dict):
    assert set(ours) == set(want)
    for name, value in want.items():
        value = float(value)
        got = float(ours[name])
        assert math.isfinite(got), name
        assert got == pytest.approx(value, rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("empty_row", [False, True], ids=["rows", "empty-row"])
@pytest.mark.parametrize("seed", [0, 1])
def test_offpolicy_metrics_equal_verl(verl, seed, empty_row):
    train, rollout, mask = batch(seed, empty_row=empty_row)
    assert_same(
        rollout_corr.offpolicy_metrics(train, rollout, mask),
        verl.compute_offpolicy_metrics(train, rollout, mask.float()),
    )
    assert_same(
        rollout_corr.offpolicy_metrics(train, None, mask), verl.compute_offpolicy_metrics(train, None, mask.float())
    )


@pytest.mark.parametrize("threshold", [2.0, 1.3, "0.8_1.25", "0.5_3.0"], ids=str)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("empty_row", [False, True], ids=["rows", "empty-row"])
def test_is_weights_and_metrics_equal_verl(verl, level, threshold, empty_row):
    train, rollout, mask = batch(2, empty_row=empty_row)
    log_ratio = train - rollout
    want_weights, want = verl.compute_rollout_correction_weights(log_ratio, mask.float(), level, threshold)
    upper, lower = verl._parse_rollout_is_threshold(threshold)
    weights, raw, for_metrics = rollout_corr.is_weights(log_ratio, mask, level, upper, lower)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)
    ours = rollout_corr.is_metrics(weights, raw, for_metrics, mask, level, upper, lower)
    assert_same(ours, want)
    if level == "sequence":  # the product of the token ratios, not their geometric mean
        row = 4
        product = math.exp(float(log_ratio[row][mask[row]].double().sum()))
        assert float(raw[row, 0]) == pytest.approx(product, rel=1e-5)


def test_rollout_corr_metrics_are_verls_prefixed_names(verl):
    train, rollout, mask = batch(3)
    ours = rollout_corr.rollout_corr_metrics(train, rollout, mask, level="token", upper=2.0)
    _, is_part = verl.compute_rollout_correction_weights(train - rollout, mask.float(), "token", 2.0)
    want = {**is_part, **verl.compute_offpolicy_metrics(train, rollout, mask.float())}
    assert_same(ours, {"rollout_corr/" + name: value for name, value in want.items()})


def test_nothing_masked_in_gives_finite_metrics():
    train, rollout, mask = batch(4)
    mask[:] = False
    metrics = rollout_corr.rollout_corr_metrics(train, rollout, mask, level="token", upper=2.0)
    assert all(math.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["rollout_corr/kl"]) == 0 and float(metrics["rollout_corr/rollout_is_mean"]) == 0


@pytest.mark.parametrize(
    "call, word",
    [
        (lambda t, m: rollout_corr.is_weights(t, m, "geometric", 2.0), "level"),
        (lambda t, m: rollout_corr.is_weights(t, m, "token", 0.0), "upper"),
        (lambda t, m: rollout_corr.is_weights(t, m, "token", 2.0, 3.0), "lower"),
        (lambda t, m: rollout_corr.is_weights(t[:, :3], m, "token", 2.0), "log_ratio"),
        (lambda t, m: rollout_corr.offpolicy_metrics(t, t[:1], m), "rollout_log_prob"),
    ],
    ids=["level", "upper", "lower", "log_ratio-shape", "rollout-shape"],
)
def test_bad_arguments_are_named(call, word):
    train, _, mask = batch(5)
    with pytest.raises(ValueError, match=word):
        call(train, mask)
