"""The Triton backend's two paths against the float64 reference, and which path runs when.

The token-local three-matmul path (`three_matmul.py`) serves the configurations whose
per-token gradient is local, the default among them; the two-pass path (forward sweep,
backward sweep) serves sequence-level ratios and the entropy quantile. Both run here under
TRITON_INTERPRET=1 on small shapes with several chunks forced, every kernel output buffer
poisoned with NaN, against `backend="reference"` in float64 with the tolerances of
`tolerances.py`; the memory recorder checks that neither builds an [N, V] tensor.
"""

from __future__ import annotations

import pytest
import torch
from parity import DEVICE, make_problem, run
from tolerances import TOLERANCES, assert_close, assert_grad_close  # noqa: E402
from triton_harness import KernelMemoryRecorder, check_against_reference, checked_inputs, loss_op_args

from sage_kernels import LossConfig, fused_linear_sage_loss  # noqa: E402
from sage_kernels.triton import boundary, gemm, ops_three_matmul, sweep_fwd, three_matmul, tiles

THREE, TWO = "three-matmul", "two-pass"


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Every buffer a kernel writes starts as NaN."""
    monkeypatch.setattr(tiles, "POISON_BUFFERS", True)


@pytest.fixture
def small_chunks(monkeypatch):
    """Several three-matmul token chunks (the last one short) and several two-pass vocab chunks."""
    monkeypatch.setitem(tiles.TILE_OVERRIDE, "chunk_n", 7)
    monkeypatch.setitem(tiles.TILE_OVERRIDE, "chunk_v", 2 * tiles.tiles_for(torch.float32).block_v)


def path_of(call) -> str:
    """The one path `call()` took."""
    before = three_matmul.PATHS_TAKEN.copy()
    call()
    taken = three_matmul.PATHS_TAKEN - before
    assert sum(taken.values()) == 1, taken
    return next(iter(taken))


def path_of_result(call, expected: str):
    """`call()`'s result, asserting it took the `expected` path."""
    result = []
    assert path_of(lambda: result.append(call())) == expected
    return result[0]


# ---------------------------------------------------------------- which path runs


@pytest.mark.parametrize(
    "options, expected",
    [
        ({}, THREE),
        ({"loss_type": "bnpo", "kl": "k2", "guide": "none"}, THREE),
        ({"loss_type": "dr_grpo", "delta_clip": 2.0, "dual_clip_c": 3.0, "entropy_coef": 0.01}, THREE),
        ({"loss_type": "dapo", "num_items_in_batch": 11}, THREE),
        ({"importance_sampling": "sequence"}, TWO),
        ({"top_entropy_quantile": 0.5}, TWO),
    ],
    ids=["default", "bnpo", "dr_grpo", "dapo", "sequence", "quantile"],
)
def test_the_default_configuration_takes_the_three_matmul_path(options, expected):
    problem = make_problem(B=2, L=5, V=200, D=32, seed=1)
    config = LossConfig(**options)
    assert path_of(lambda: run(problem, config, "triton", torch.float32)) == expected
    assert three_matmul.exact_for(LossConfig())


def test_scoring_and_no_grad_calls_take_a_path_too():
    problem = make_problem(B=2, L=5, V=200, D=32, seed=2)
    with torch.no_grad():
        assert path_of(lambda: fused_linear_sage_loss(backend="triton", **problem)) == THREE


# ---------------------------------------------------------------- the three-matmul path against the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mask", ["random", "tail", "all"])
def test_three_matmul_dtypes_and_masks(dtype, mask, small_chunks):
    # N = 39 over 7-row chunks; V = 1271 and D = 40 leave tails in every block.
    problem = make_problem(B=3, L=13, V=1271, D=40, dtype=dtype, seed=5, mask=mask, is_weights=True)
    config = LossConfig(entropy_coef=0.01, temperature=0.7, dual_clip_c=3.0)
    expected = TWO if dtype == torch.float16 else THREE  # fp16: see test_fp16_survives_loss_scaling
    assert path_of(lambda: check_against_reference(problem, config, dtype)) == expected


@pytest.mark.parametrize("options", [{}, {"importance_sampling": "sequence"}], ids=["default", "sequence"])
def test_fp16_survives_loss_scaling(options):
    # torch.amp.GradScaler's upstream gradient (2^16) and a 16k-token normaliser (per-token gradient
    # ~6e-5): d(logits) must be formed after the scale is applied, or g * p flushes to zero in fp16
    problem = make_problem(B=2, L=8, V=300, D=32, dtype=torch.float16, seed=3)
    config = LossConfig(loss_type="dapo", num_items_in_batch=16384, **options)
    upstream = 2.0**16
    _, grads = path_of_result(lambda: run(problem, config, "triton", torch.float16, upstream=upstream), TWO)
    _, expected = run(problem, config, "reference", torch.float64, upstream=upstream)
    for name in ("hidden", "weight", "bias"):
        assert torch.isfinite(grads[name]).all()
        assert_grad_close(grads[name], expected[name], torch.float16, f"grad {name}")


@pytest.mark.parametrize(
    "options",
    [
        {"kl": "k1", "beta": 0.2, "guide": "none"},
        {"kl": "k2", "beta": 0.2, "loss_type": "bnpo"},
        {"kl": "fk3", "beta": 0.3, "loss_type": "dr_grpo", "max_completion_length": 20, "delta_clip": 1.5},
        {"kl": "k3", "beta": 0.0, "loss_type": "dapo", "num_items_in_batch": 17, "entropy_coef": 0.05},
        {"tau": 5.0, "gamma": 2.0, "eps_low": 0.1, "eps_high": 0.3, "temperature": 1.3},
    ],
    ids=["k1-none", "k2-bnpo", "fk3-dr_grpo-delta", "dapo-n-entropy", "branch-clamped"],
)
@pytest.mark.parametrize(
    "present",
    [
        {"bias": True, "old": True, "log_q": False, "adv_per_token": False},
        {"bias": False, "old": False, "log_q": True, "adv_per_token": True},
    ],
    ids=["bias-old", "logq-onpolicy"],
)
def test_three_matmul_options(options, present, small_chunks):
    problem = make_problem(B=3, L=9, V=300, D=40, seed=len(options), **present)
    config = LossConfig(**options)
    assert path_of(lambda: check_against_reference(problem, config, torch.float32)) == THREE


def test_three_matmul_num_items_as_a_device_tensor(small_chunks):
    problem = make_problem(B=3, L=11, V=200, D=32, seed=6)
    n = torch.tensor(23.0, device=DEVICE)
    check_against_reference(problem, LossConfig(loss_type="dapo", num_items_in_batch=n), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_three_matmul_frozen_weight_and_count_left_on_the_device(dtype, small_chunks, monkeypatch):
    # As under CUDA-graph capture: every row is covered and the kernels skip those past the count.
    monkeypatch.setattr(sweep_fwd, "READ_VALID_COUNT", False)
    problem = make_problem(B=3, L=9, V=300, D=40, dtype=dtype, seed=8, mask="tail")
    check_against_reference(problem, LossConfig(entropy_coef=0.01), dtype, frozen_weight=True)


def test_three_matmul_hidden_without_gradient(small_chunks):
    # need_hidden honoured: only the weight (and bias) gradients are formed
    problem = make_problem(B=2, L=9, V=300, D=40, seed=9)
    weight = problem["weight"].detach().requires_grad_()
    bias = problem["bias"].detach().requires_grad_()
    rest = {k: v for k, v in problem.items() if k not in ("weight", "bias")}
    out = fused_linear_sage_loss(weight=weight, bias=bias, backend="triton", **rest)
    out.loss.backward()
    ref_w = problem["weight"].double().requires_grad_()
    ref_b = problem["bias"].double().requires_grad_()
    rest64 = dict(rest, hidden=rest["hidden"].double())
    fused_linear_sage_loss(weight=ref_w, bias=ref_b, backend="reference", **rest64).loss.backward()
    for got, want in ((weight.grad, ref_w.grad), (bias.grad, ref_b.grad)):
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err <= TOLERANCES[torch.float32]["grad"]


def test_three_matmul_gradients_are_deterministic(small_chunks):
    problem = make_problem(B=3, L=9, V=600, D=48, seed=12, is_weights=True)
    first, first_grads = run(problem, LossConfig(entropy_coef=0.01), "triton", torch.bfloat16, upstream=0.7)
    second, second_grads = run(problem, LossConfig(entropy_coef=0.01), "triton", torch.bfloat16, upstream=0.7)
    assert torch.equal(first.loss, second.loss)
    for name, grad in first_grads.items():
        assert torch.equal(grad, second_grads[name]), name


def test_three_matmul_everything_masked(small_chunks):
    problem = make_problem(B=2, L=6, V=300, D=32, mask="none")
    out, grads = run(problem, LossConfig(entropy_coef=0.1), "triton", torch.float32, upstream=1.3)
    assert out.loss.item() == 0.0
    assert all(torch.isnan(v) for v in out.metrics.values())  # no token: no metric value
    for name, grad in grads.items():
        assert torch.equal(grad, torch.zeros_like(grad)), name


#: the loss types the three-matmul path took on once `exact_for` asked only for a local per-token gradient,
#: each with its own options away from their defaults (a trust region, a temperature, a cap)
TOKEN_LOCAL_TYPES = {
    "cispo": dict(loss_type="cispo", eps_high=0.3, num_items_in_batch=17),
    "sapo": dict(loss_type="sapo", sapo_temperature_neg=0.7, entropy_coef=0.02),
    "dppo_tv": dict(loss_type="dppo_tv", eps_low=0.1, eps_high=0.15, dppo_ratio_cap=1.5, kl="k1+", beta=0.1),
    "dppo_kl": dict(loss_type="dppo_kl", eps_low=0.05, eps_high=0.08, guide="branch", tau=0.5, gamma=1.0),
    "luspo": dict(loss_type="luspo", delta_clip=1.5, temperature=0.8),
}


def packed_problem(dtype, seed):
    """Three packed sequences (one empty, prompts masked) with every optional input: hidden [N, D]."""
    lengths, D, V = [5, 0, 7, 4], 24, 157
    gen = torch.Generator().manual_seed(seed)
    N = sum(lengths)
    hidden = torch.randn(N, D, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, D, generator=gen, dtype=torch.float64) / D**0.5).to(dtype)
    mask = torch.rand(N, generator=gen) > 0.3
    logp = torch.randn(N, generator=gen) - 5.0
    cu = torch.tensor([0, 5, 5, 12, 16])
    return dict(
        hidden=hidden,
        weight=weight,
        bias=(0.5 * torch.randn(V, generator=gen)).to(dtype),
        token_ids=torch.randint(0, V, (N,), generator=gen),
        mask=mask,
        advantages=torch.randn(len(lengths), generator=gen),
        old_logp=logp + 0.3 * torch.randn(N, generator=gen),
        ref_logp=logp + 0.5 * torch.randn(N, generator=gen),
        cu_seqlens=cu,
    )


def run_packed(problem, config, backend, dtype, upstream):
    leaves = {k: problem[k].detach().to(dtype).clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    rest = {k: v for k, v in problem.items() if k not in leaves}
    out = fused_linear_sage_loss(**leaves, **rest, config=config, backend=backend)
    (out.loss * upstream).backward()
    return out, {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("loss_type", sorted(TOKEN_LOCAL_TYPES))
def test_every_token_local_loss_type_takes_the_three_matmul_path(loss_type, dtype, small_chunks):
    # padded: against the float64 reference on everything (`check_against_reference`)
    config = LossConfig(**TOKEN_LOCAL_TYPES[loss_type])
    assert three_matmul.exact_for(config)
    problem = make_problem(B=3, L=7, V=157, D=24, dtype=dtype, seed=len(loss_type), mask="tail")
    assert path_of(lambda: check_against_reference(problem, config, dtype, seed=3)) == THREE
    # packed: the same loss, logp and gradients as the float64 reference on the same packed call
    packed = packed_problem(dtype, seed=len(loss_type) + 1)
    out, grads = path_of_result(lambda: run_packed(packed, config, "triton", dtype, 1.3), THREE)
    ref, ref_grads = run_packed(packed, config, "reference", torch.float64, 1.3)
    assert_close(out.loss, ref.loss, dtype, "loss", "loss")
    assert_close(out.logp, ref.logp, dtype, "token", "logp")
    for name, grad in grads.items():
        assert grad.dtype == dtype
        assert_grad_close(grad, ref_grads[name], dtype, f"grad {name}")
    assert bool((grads["hidden"][~packed["mask"]] == 0).all())


def test_luspo_include_padding_keeps_the_two_pass_path():
    # its padded rows enter the loss; the three-matmul path covers only the valid ones
    config = LossConfig(loss_type="luspo", luspo_include_padding=True)
    assert not three_matmul.exact_for(config) and three_matmul.exact_for(LossConfig(loss_type="luspo"))
    problem = make_problem(B=2, L=5, V=200, D=32, seed=4, mask="tail")
    assert path_of(lambda: check_against_reference(problem, config, torch.float32)) == TWO


# ---------------------------------------------------------------- the two-pass path, compacted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("read_count", [True, False], ids=["count-read", "count-on-device"])
def test_two_pass_compacted_backward(dtype, read_count, small_chunks, monkeypatch):
    monkeypatch.setattr(sweep_fwd, "READ_VALID_COUNT", read_count)
    problem = make_problem(B=4, L=9, V=1271, D=40, dtype=dtype, seed=3, mask="tail", is_weights=True)
    config = LossConfig(entropy_coef=0.02, importance_sampling="sequence")
    assert path_of(lambda: check_against_reference(problem, config, dtype)) == TWO


def test_two_pass_nothing_masked_and_hidden_without_gradient(small_chunks):
    problem = make_problem(B=2, L=9, V=300, D=40, seed=4, mask="all")
    config = LossConfig(top_entropy_quantile=0.5, entropy_coef=0.01)
    check_against_reference(problem, config, torch.float32)
    hidden = problem["hidden"]  # no gradient wanted: the backward skips its GEMM
    weight = problem["weight"].detach().requires_grad_()
    rest = {k: v for k, v in problem.items() if k not in ("hidden", "weight")}
    fused_linear_sage_loss(hidden, weight, config=config, backend="triton", **rest).loss.backward()
    assert hidden.grad is None and torch.isfinite(weight.grad).all()


# ---------------------------------------------------------------- memory and helpers


class ViewSkippingRecorder(KernelMemoryRecorder):
    """Skips views too: the bf16 view of the fp32 logits workspace (d(logits) in place) has twice its
    elements in the same bytes, and allocates nothing."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_three_matmul_stays_under_the_logits_limit(dtype):
    B, L, V, D = 4, 64, 1024, 12  # D < N/16 and V/16 keeps the gradients themselves under the limit
    problem = make_problem(B=B, L=L, V=V, D=D, dtype=dtype, mask="tail", is_weights=True)
    config = LossConfig(entropy_coef=0.01)
    inputs = checked_inputs(problem, config)
    with ViewSkippingRecorder(B * L * V // 16) as recorder:
        wanted = boundary.GradsWanted(hidden=True, weight=True, bias=True)
        out = ops_three_matmul.local_forward(boundary.LossTensors.of(inputs), config, wanted)
    recorder.check()
    assert recorder.largest > 0
    assert all(torch.isfinite(t).all() for t in out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fp32_output_products(dtype):
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((9, 70), (70, 5)))
    a16, b16 = a.to(dtype), b.to(dtype)
    exact = a16.double() @ b16.double()
    out = torch.full((9, 5), float("nan"))
    gemm.mm_f32(a16, b16, out)
    acc = torch.ones(9, 5)
    gemm.addmm_f32_(acc, a16, b16)
    for got, want in ((out, exact), (acc, exact + 1.0)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert gemm.has_fp32_output(dtype, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("slices", [4, 6, 8])
def test_sliced_product_is_exact(slices, dtype):
    # d(hidden)'s operand as the path holds it: a 16-bit view of an fp32 row (row stride twice V);
    # K = 1003 leaves a remainder past the equal slices
    gen = torch.Generator().manual_seed(slices)
    m, k, n = 9, 1003, 40
    rows = torch.randn(m, k, generator=gen, dtype=torch.float64)
    a = torch.zeros(m, k, dtype=torch.float32).view(dtype)[:, :k] if dtype != torch.float32 else rows.float()
    if dtype != torch.float32:
        a.copy_(rows.to(dtype))
        assert a.stride(0) == 2 * k
    b = torch.randn(k, n, generator=gen, dtype=torch.float64).to(dtype)
    exact = a.double() @ b.double()
    outs = []
    for _ in range(2):
        out = torch.full((m, n), float("nan"))
        partials = torch.full((slices, m, n), float("nan"))
        outs.append(gemm.sliced_mm_f32(a, b, out, partials))
        assert outs[-1].data_ptr() == out.data_ptr() and out.dtype == torch.float32
    # within fp32 summation's rounding of the products' magnitudes (the float64 product: no rounding)
    scale = a.double().abs() @ b.double().abs()
    assert bool(((outs[0].double() - exact).abs() <= 2**-16 * scale).all())
    assert torch.equal(outs[0], outs[1])  # the same bits for the same shape


@pytest.mark.parametrize(
    "rows, cols, inner, sms",
    [(640, 3584, 152_064, 132), (640, 1536, 151_936, 132), (640, 896, 151_936, 132), (512, 4096, 128_256, 78)],
    ids=["7b-h100", "1.5b-h100", "0.5b-h100", "8b-small-gpu"],
)
def test_vocab_slices_fill_the_last_wave(rows, cols, inner, sms):
    slices = gemm.slice_count(rows, cols, inner, sms)
    tiles = -(-rows // 128) * -(-cols // 128)
    assert tiles < gemm.FULL_WAVES * sms  # a shape that needs it: every one here splits

    def filled(s):
        return tiles * s / (-(-tiles * s // sms) * sms)

    assert gemm.MIN_SLICES <= slices <= gemm.MAX_SLICES
    assert slices * rows * cols * 4 <= gemm.PARTIAL_BYTES
    assert filled(slices) > filled(1)
    assert all(filled(slices) >= filled(s) for s in range(gemm.MIN_SLICES, slices))
    assert gemm.slice_count(rows, cols, inner, sms) == slices  # the shape and the SM count decide


def test_vocab_slices_leave_full_or_short_products_whole():
    assert gemm.slice_count(16_384, 3584, 152_064, 132) == 1  # 3584 tiles: 27 full waves
    assert gemm.slice_count(640, 3584, 6000, 132) == 1  # K too short for 4 slices of 2048
    assert gemm.slice_count(0, 3584, 152_064, 132) == 1
    assert gemm.vocab_slices(torch.device("cpu"), torch.bfloat16, 640, 3584, 152_064) == 1  # CPU: one product


@pytest.mark.parametrize(
    "dtype, mask", [(torch.float32, "all"), (torch.bfloat16, "tail")], ids=["fp32-into-the-gradient", "bf16-masked"]
)
def test_three_matmul_with_a_sliced_d_hidden(dtype, mask, small_chunks, monkeypatch):
    # 5 slices of V = 1271 (a remainder of 1 column) in every chunk, the last one short; fp32 with nothing
    # masked sums the partials straight into the gradient, bf16 with a mask through the fp32 chunk buffer
    monkeypatch.setitem(tiles.TILE_OVERRIDE, "dh_slices", 5)
    problem = make_problem(B=3, L=9, V=1271, D=40, dtype=dtype, seed=21, mask=mask)
    config = LossConfig(entropy_coef=0.01)
    assert path_of(lambda: check_against_reference(problem, config, dtype)) == THREE


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_launches_follow_the_tensors_device():
    # Tensors on the second GPU while the first is current: every launch must follow the tensors.
    problem = make_problem(B=2, L=64, V=1000, D=64, seed=14, mask="tail")
    problem = {k: v.to("cuda:1") if isinstance(v, torch.Tensor) else v for k, v in problem.items()}
    with torch.cuda.device(0):
        for config in (LossConfig(), LossConfig(importance_sampling="sequence")):
            check_against_reference(problem, config, torch.float32)


def test_three_matmul_backward_twice_is_refused():
    # the gradients are scaled in place by the upstream gradient: a second backward would scale twice
    problem = make_problem(B=2, L=5, V=200, D=32, seed=15)
    hidden = problem["hidden"].detach().requires_grad_()
    rest = {k: v for k, v in problem.items() if k != "hidden"}
    loss = fused_linear_sage_loss(hidden, backend="triton", **rest).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward called twice"):
        loss.backward()


def test_opcheck_local_loss_operator():
    problem = make_problem(B=2, L=5, V=200, D=32, seed=1)
    needs = boundary.GradsWanted(hidden=True, weight=True, bias=False).flat()
    torch.library.opcheck(
        torch.ops.sage_kernels.triton_sage_loss_local.default,
        (*loss_op_args(problem, LossConfig(entropy_coef=0.01)), needs),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


@pytest.mark.parametrize("hidden_size, accumulator", [(16, torch.float32), (48, torch.bfloat16)])
def test_three_matmul_weight_accumulator(hidden_size, accumulator, small_chunks, monkeypatch):
    # N = 27 * 27 = 729 tokens: D = 16 < N/16 accumulates grad_W in fp32, D = 48 in bf16
    assert three_matmul._weight_accumulator_dtype(torch.bfloat16, 729, hidden_size) == accumulator
    monkeypatch.setitem(tiles.TILE_OVERRIDE, "chunk_n", 160)
    problem = make_problem(B=27, L=27, V=130, D=hidden_size, dtype=torch.bfloat16, seed=16, mask="tail")
    check_against_reference(problem, LossConfig(), torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE.type != "cuda", reason="a real vocabulary is too large for the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vocab", [50_257, 50_304])  # odd (scalar row loads) and V % 16 == 0 (128-bit ones)
def test_three_matmul_in_place_d_logits_on_a_real_vocabulary(vocab, dtype):
    # Hundreds of vocab blocks per row on the GPU: d(logits) overwrites each fp32 row in place while
    # warps may drift apart, so a missing barrier would show here as wrong gradients.
    problem = make_problem(B=4, L=64, V=vocab, D=128, dtype=dtype, seed=17, mask="tail", is_weights=True)
    config = LossConfig(entropy_coef=0.01, temperature=0.9)
    assert path_of(lambda: check_against_reference(problem, config, dtype)) == THREE


def test_the_fp32_output_probe_is_a_constant_to_torch_compile():
    # the path choice probes cuBLAS once per device and dtype; traced code must not contain (or break
    # at) the probe's CUDA work. Here torch has no CUDA: the probe answers False, once.
    gemm._probe.cache_clear()

    def pick(x):
        return x * 2 if gemm.has_fp32_output(torch.bfloat16, torch.device("cuda", 0)) else x * 3

    compiled = torch.compile(pick, backend="aot_eager", fullgraph=True)  # fullgraph: a break would raise
    expected = 2 if torch.cuda.is_available() and gemm._probe(torch.device("cuda", 0), torch.bfloat16, False) else 3
    for _ in range(2):
        assert torch.equal(compiled(torch.ones(2)), torch.full((2,), float(expected)))
    assert gemm._probe.cache_info().misses == 1


@pytest.mark.parametrize("n", [4096, 16384, 21_000, 32_768, 57_000, 200_000])
def test_token_chunks_are_few_and_the_workspace_below_the_logits_bound(n):
    # a 16-bit weight gradient is rounded once per chunk: at most MAX_CHUNKS of them, at any N
    rows = three_matmul.chunk_rows(n, n, 152_064)
    assert -(-n // rows) <= three_matmul.MAX_CHUNKS
    assert rows * 152_064 < n * 152_064 // 16
    # the workspace grows past its budget only as far as the chunk count needs (rows in multiples of 64)
    rows_by_count = -(-n // three_matmul.MAX_CHUNKS) + three_matmul.ROW_MULTIPLE
    assert rows * 152_064 * 4 <= max(three_matmul.WORKSPACE_BYTES, rows_by_count * 152_064 * 4)
