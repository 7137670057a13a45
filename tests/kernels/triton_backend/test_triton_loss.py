"""The fused Triton loss against the float64 reference: loss, per-token outputs, metrics, gradients.

Runs on CUDA when available, else on CPU under TRITON_INTERPRET=1 (set by conftest.py).
Each case runs `backend="triton"` on inputs of the tested dtype and `backend="reference"`
on the same values cast to float64, backpropagates loss * (a random scalar) through
both and compares everything with the tolerances of `tolerances.py`. Kernel output
buffers are poisoned with NaN, so an element a kernel forgets to write fails.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from parity import DEVICE, make_problem, run
from triton_harness import check_against_reference

from sage_kernels import LossConfig
from sage_kernels.triton import three_matmul, tiles


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Every buffer a kernel writes starts as NaN."""
    monkeypatch.setattr(tiles, "POISON_BUFFERS", True)


# ---------------------------------------------------------------- options, drawn by hypothesis

options = st.fixed_dictionaries(
    {
        "beta": st.sampled_from([0.0, 0.05, 0.3]),
        "kl": st.sampled_from(["k1", "k2", "k3", "fk3"]),
        "guide": st.sampled_from(["none", "branch"]),
        "gamma": st.floats(0.0, 1.0),
        "tau": st.floats(0.5, 3.0),
        "loss_type": st.sampled_from(["grpo", "bnpo", "dr_grpo", "dapo"]),
        "eps_low": st.floats(0.05, 0.4),
        "eps_high": st.floats(0.05, 0.5),
        "delta_clip": st.one_of(st.none(), st.floats(1.1, 3.0)),
        "dual_clip_c": st.one_of(st.none(), st.floats(1.5, 4.0)),
        "importance_sampling": st.sampled_from(["token", "sequence"]),
        "top_entropy_quantile": st.sampled_from([1.0, 0.8, 0.3]),
        "entropy_coef": st.sampled_from([0.0, 0.02]),
        "temperature": st.floats(0.5, 1.5),
        "logit_scale": st.floats(0.5, 2.0),
        "logit_softcap": st.one_of(st.none(), st.floats(0.5, 5.0)),
        "kl_clamp": st.one_of(st.none(), st.floats(0.2, 2.0)),
    }
)
inputs_present = st.fixed_dictionaries(
    {
        "old": st.booleans(),
        "is_weights": st.booleans(),
        "log_q": st.booleans(),
        "bias": st.booleans(),
        "adv_per_token": st.booleans(),
        "mask": st.sampled_from(["random", "tail"]),
    }
)


# No shrinking: each example costs seconds under the interpreter; the failing one is printed as drawn.
@settings(max_examples=20, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(opts=options, present=inputs_present, frozen=st.booleans(), seed=st.integers(0, 1000))
def test_every_option_matches_the_reference_fp32(opts, present, frozen, seed):
    problem = make_problem(B=3, L=9, V=300, D=40, seed=seed, **present)
    check_against_reference(problem, LossConfig(**opts), torch.float32, frozen_weight=frozen, seed=seed)


@pytest.mark.parametrize("kl", ["k1", "k2", "k3", "fk3"])
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
def test_kl_estimators_and_ratio_levels(kl, importance_sampling):
    problem = make_problem(B=4, L=7, V=257, D=48, seed=3)
    config = LossConfig(kl=kl, importance_sampling=importance_sampling, beta=0.2, entropy_coef=0.01)
    check_against_reference(problem, config, torch.float32)


@pytest.mark.parametrize("guide", ["none", "branch", "log_q"])
def test_guides(guide):
    # Entropies here are about 5 nats: tau = 5 puts tokens on both sides of the fork threshold,
    # and gamma = 2 lifts some of them to the q_max clamp.
    problem = make_problem(B=3, L=8, V=300, D=32, seed=8, log_q=guide == "log_q")
    config = LossConfig(guide="none" if guide == "none" else "branch", tau=5.0, gamma=2.0, beta=0.3)
    out = check_against_reference(problem, config, torch.float32)
    if guide != "none":
        assert out.metrics["sage/q_max"] > 1.0


@pytest.mark.parametrize(
    "loss_type, extra",
    [
        ("grpo", {}),
        ("bnpo", {}),
        ("dr_grpo", {"max_completion_length": 20}),
        ("dapo", {}),
        ("dapo", {"num_items_in_batch": 17}),
    ],
)
def test_loss_types_and_normalisers(loss_type, extra):
    problem = make_problem(B=3, L=11, V=200, D=32, seed=5, mask="tail")
    check_against_reference(problem, LossConfig(loss_type=loss_type, **extra), torch.float32)


def test_num_items_as_a_device_tensor():
    problem = make_problem(B=3, L=11, V=200, D=32, seed=6)
    n = torch.tensor(23.0, device=DEVICE)
    check_against_reference(problem, LossConfig(loss_type="dapo", num_items_in_batch=n), torch.float32)


# ---------------------------------------------------------------- dtypes and hostile shapes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("V, D", [(1000, 96), (1271, 96), (1271, 40)])
def test_dtypes_on_hostile_shapes(dtype, V, D):
    # N = 39 is not a multiple of any block; V and D leave tails in every tile size used.
    problem = make_problem(B=3, L=13, V=V, D=D, dtype=dtype, seed=V + D, is_weights=True)
    check_against_reference(problem, LossConfig(entropy_coef=0.01, temperature=0.7, dual_clip_c=3.0), dtype)


@pytest.mark.parametrize("weight_scale", [0.0, 40.0], ids=["flat", "confident"])
def test_flat_and_confident_logits(weight_scale):
    problem = make_problem(B=2, L=9, V=1000, D=64, seed=11, weight_scale=weight_scale)
    check_against_reference(problem, LossConfig(entropy_coef=0.05, beta=0.1), torch.float32)


def test_flat_logits_have_entropy_log_v():
    problem = make_problem(B=2, L=5, V=1000, D=32, weight_scale=0.0, bias=False, mask="all")
    out, _ = run(problem, LossConfig(), "triton", torch.float32)
    torch.testing.assert_close(out.entropy, torch.full_like(out.entropy, math.log(1000)), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logp, torch.full_like(out.logp, -math.log(1000)), atol=1e-5, rtol=0)


def test_all_positions_masked_give_zero_loss_and_zero_gradient():
    problem = make_problem(B=2, L=6, V=300, D=32, mask="none")
    out, grads = run(
        problem, LossConfig(entropy_coef=0.1, top_entropy_quantile=0.5), "triton", torch.float32, upstream=1.3
    )
    assert out.loss.item() == 0.0
    assert torch.equal(out.logp, torch.zeros_like(out.logp))
    assert torch.equal(out.q, torch.ones_like(out.q)) and torch.equal(out.ratio, torch.ones_like(out.ratio))
    for name, grad in grads.items():
        assert torch.equal(grad, torch.zeros_like(grad)), name
    assert all(torch.isnan(v) for v in out.metrics.values())  # no token: no metric value (the reference's)


def test_vocab_splits_token_blocks_and_backward_chunks(monkeypatch):
    # Force the multi-split forward and several backward chunks on a tiny problem; 16-row token
    # blocks in groups of 2 leave a short last group in the backward's launch order.
    tile = tiles.tiles_for(torch.float32)
    monkeypatch.setitem(tiles.TILE_OVERRIDE, "splits", 3)
    monkeypatch.setitem(tiles.TILE_OVERRIDE, "block_n", 16)
    monkeypatch.setitem(tiles.TILE_OVERRIDE, "group_n", 2)
    monkeypatch.setitem(tiles.TILE_OVERRIDE, "chunk_v", 2 * tile.block_v)
    problem = make_problem(B=5, L=15, V=1271, D=72, seed=2, mask="tail")
    check_against_reference(problem, LossConfig(entropy_coef=0.02, importance_sampling="sequence"), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", ["three-matmul", "two-pass"])
@pytest.mark.parametrize("softcap", [None, 1.5], ids=["scale-only", "softcap"])
def test_scaled_and_softcapped_logits(softcap, path, dtype):
    # head outputs ~N(0, 1.5^2) scaled by 2.5: a softcap of 1.5 saturates most of them (tanh' small)
    problem = make_problem(B=3, L=9, V=300, D=40, dtype=dtype, seed=31, weight_scale=1.5)
    sequence = path == "two-pass"  # sequence-level ratios need every token first: the two-pass path
    config = LossConfig(
        logit_scale=2.5,
        logit_softcap=softcap,
        temperature=0.8,
        entropy_coef=0.02,
        importance_sampling="sequence" if sequence else "token",
    )
    before = three_matmul.PATHS_TAKEN.copy()
    check_against_reference(problem, config, dtype)
    assert three_matmul.PATHS_TAKEN - before == {path: 1}


def test_temperature_and_beta_are_runtime_scalars():
    # The same kernels serve every value; each value still matches the reference.
    problem = make_problem(B=2, L=8, V=300, D=32, seed=9)
    for temperature, beta, gamma, tau in ((0.6, 0.0, 0.3, 1.2), (1.3, 0.2, 0.7, 0.4)):
        check_against_reference(
            problem, LossConfig(temperature=temperature, beta=beta, gamma=gamma, tau=tau), torch.float32
        )


def test_poisoned_buffers_are_enabled():
    # Guards the fixture itself: a buffer from the allocation helper really starts as NaN.
    assert torch.isnan(tiles.new_buffer((3,), torch.float32, DEVICE)).all()


def test_deterministic_gradients():
    # No atomics: two runs give bitwise-equal loss and gradients.
    problem = make_problem(B=4, L=9, V=600, D=48, seed=12, is_weights=True)
    config = LossConfig(entropy_coef=0.01, importance_sampling="sequence")
    first, first_grads = run(problem, config, "triton", torch.bfloat16, upstream=0.7)
    second, second_grads = run(problem, config, "triton", torch.bfloat16, upstream=0.7)
    assert torch.equal(first.loss, second.loss)
    for name, grad in first_grads.items():
        assert torch.equal(grad, second_grads[name]), name


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE.type != "cuda", reason="70,000 tokens are too many for the interpreter")
def test_more_tokens_than_a_grid_dimension_holds():
    # N > 65,535: tokens run on grid axis 0 (limit 2^31 - 1), never on the 65,535-limited axes.
    problem = make_problem(B=7, L=10_000, V=256, D=64, seed=13, mask="tail")
    check_against_reference(problem, LossConfig(entropy_coef=0.01), torch.float32)


@pytest.mark.parametrize("kl", ["k3", "fk3"])
def test_kl_clamp_keeps_an_extreme_token_finite(kl):
    """One token with log(pi_ref / pi) = +100 overflows k3 / fk3 (the default clamps nothing, as TRL);
    with kl_clamp its KL is the estimator at the bound and its KL gradient zero, on every backend."""
    problem = make_problem(B=2, L=4, V=64, D=16, seed=5)
    problem["ref_logp"] = problem["ref_logp"].clone()
    problem["ref_logp"][0, 1] = problem["ref_logp"][0, 1] + 100.0
    unclamped, _ = run(problem, LossConfig(kl=kl), "reference", torch.float32)
    assert not torch.isfinite(unclamped.loss)
    config = LossConfig(kl=kl, kl_clamp=20.0)
    out = check_against_reference(problem, config, torch.float32)
    assert torch.isfinite(out.loss)
    bound = torch.tensor(20.0, dtype=torch.float64)
    at_bound = torch.exp(bound) - 1 - bound if kl == "k3" else torch.exp(bound) * bound - torch.expm1(bound)
    assert out.kl[0, 1].item() == pytest.approx(at_bound.item(), rel=1e-5)
