"""Packed sequences (``cu_seqlens``, docs/loss.md "Packed sequences") against the padded call on the
same sequences, on every backend: the loss, the per-token outputs, the metrics and the gradients of
hidden, weight and bias under a random upstream gradient, for every loss type with the options and
inputs drawn by hypothesis over random packings (lengths 0..7, empty sequences included). Also the
[1, N] forms, the refusals, scoring, and that no padded copy of an [N, D] or [N, V] tensor is made.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from alloc import AllocationRecorder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packed_batches import cu_of, lengths_strategy, pad, unpad
from tolerances import assert_close, assert_grad_close

from sage_kernels import LossConfig, cpu, fused_linear_sage_loss, logprobs_and_entropy
from sage_kernels.inputs import FAST_DTYPES, validate_inputs
from sage_kernels.loss_types import LOSS_TYPES
from sage_kernels.metrics import METRIC_NAMES
from sage_kernels.packing import rows_output, validate_packed_inputs
from sage_kernels.reference import reference_logprobs_and_entropy
from sage_kernels.spec import KL_CODES
from sage_kernels.triton import three_matmul

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F64 = torch.float64
PER_TOKEN = ("logp", "entropy", "q", "kl", "ratio")
OPTIONAL = ("old_logp", "ref_logp", "is_weights", "log_q", "sampling_logp")
LOSS_TYPE_NAMES = sorted(LOSS_TYPES)

#: what hypothesis draws: the options (made valid for each loss type by `config_for`) and which inputs exist.
draws = st.fixed_dictionaries(
    {
        "beta": st.sampled_from([0.0, 0.1]),
        "kl": st.sampled_from(sorted(KL_CODES)),
        "guide": st.sampled_from(["branch", "none"]),
        "sequence_ratio": st.booleans(),
        "top_entropy_quantile": st.sampled_from([1.0, 0.6]),
        "entropy_coef": st.sampled_from([0.0, 0.05]),
        "off_policy_mask_threshold": st.sampled_from([None, 0.02]),
        "use_bias_correction_kl": st.booleans(),
        "kl_clamp": st.sampled_from([None, 0.5]),
        "temperature": st.sampled_from([1.0, 0.7]),
        "logit_softcap": st.sampled_from([None, 2.5]),
        "logit_scale": st.sampled_from([1.0, 1.6]),
        "gamma": st.sampled_from([0.3, 1.0]),
        "tau": st.sampled_from([1.2, 0.5]),
        "eps_high": st.sampled_from([0.2, 0.3]),
        "sapo_temperature_neg": st.sampled_from([1.05, 0.7]),
        "vespo_lambda_pos": st.sampled_from([3.0, 1.5]),
        "delta_clip": st.sampled_from([None, 1.3]),
        "dual_clip_c": st.sampled_from([None, 2.5]),
        "max_completion_length": st.sampled_from([None, 9]),
        "num_items_in_batch": st.sampled_from([None, 7.0]),
        "old": st.booleans(),
        "ref": st.booleans(),
        "is_weights": st.booleans(),
        "log_q": st.booleans(),
        "sampling": st.booleans(),
        "bias": st.booleans(),
        "token_advantages": st.booleans(),
    }
)


def config_for(loss_type: str, drawn: dict) -> LossConfig:
    """The drawn options that `loss_type` takes (each type's own options only where they apply)."""
    kind = LOSS_TYPES[loss_type]
    options = {
        name: drawn[name]
        for name in (
            "beta",
            "kl",
            "guide",
            "top_entropy_quantile",
            "entropy_coef",
            "off_policy_mask_threshold",
            "use_bias_correction_kl",
            "kl_clamp",
            "temperature",
            "logit_softcap",
            "logit_scale",
            "gamma",
            "tau",
            "eps_high",
        )
    }
    options["importance_sampling"] = "sequence" if drawn["sequence_ratio"] and not kind.token_ratio else "token"
    if kind.clipped:
        options.update(delta_clip=drawn["delta_clip"], dual_clip_c=drawn["dual_clip_c"])
    if kind.normaliser == "max_length":
        options["max_completion_length"] = drawn["max_completion_length"]
    if kind.normaliser == "given_tokens":
        options["num_items_in_batch"] = drawn["num_items_in_batch"]
    if loss_type == "sapo":
        options["sapo_temperature_neg"] = drawn["sapo_temperature_neg"]
    if loss_type == "vespo":
        options["vespo_lambda_pos"] = drawn["vespo_lambda_pos"]
    return LossConfig(loss_type=loss_type, **options)


def make_packed(lengths, drawn: dict, *, D=16, V=97, seed=0) -> dict:
    """A packed problem: each sequence a prompt (mask 0) then completion tokens (a few masked too),
    garbage under the mask (out-of-range ids, NaN log-probs), log-probs near the policy's own."""
    gen = torch.Generator().manual_seed(seed)
    N, S = sum(lengths), len(lengths)
    scale = torch.exp(torch.empty(N, 1).uniform_(math.log(0.1), math.log(4.0), generator=gen))
    hidden = torch.randn(N, D, generator=gen, dtype=F64) * scale
    weight = torch.randn(V, D, generator=gen, dtype=F64) / math.sqrt(D)
    mask = torch.zeros(N, dtype=torch.bool)
    start = 0
    for n in lengths:
        prompt = int(torch.randint(0, n + 1, (), generator=gen))
        mask[start + prompt : start + n] = torch.rand(n - prompt, generator=gen) > 0.15
        start += n
    token_ids = torch.where(mask, torch.randint(0, V, (N,), generator=gen), V + 3)
    bias = 0.5 * torch.randn(V, generator=gen, dtype=F64) if drawn["bias"] else None
    logp, _ = reference_logprobs_and_entropy(hidden, weight, token_ids.clamp(max=V - 1), bias=bias, dtype=F64)

    def near_policy(sigma):
        return torch.where(mask, logp + sigma * torch.randn(N, generator=gen, dtype=F64), math.nan).float()

    # a 1-D [S] = [N] would read both ways when some sequence is empty: [S, 1] or [1, N] say which
    one_d = S != N or max(lengths) == 1
    advantages = torch.randn(N if drawn["token_advantages"] else S, generator=gen)
    if not one_d:
        advantages = advantages[None, :] if drawn["token_advantages"] else advantages[:, None]
    sampling = near_policy(0.2)
    sampling[torch.rand(N, generator=gen) < 0.2] = math.nan  # tokens the sampler could not score
    beta = drawn["beta"]
    problem = dict(
        hidden=hidden,
        weight=weight,
        bias=bias,
        token_ids=token_ids,
        mask=mask,
        advantages=advantages,
        old_logp=near_policy(0.3) if drawn["old"] else None,
        ref_logp=near_policy(0.5) if drawn["ref"] or beta != 0 else None,
        is_weights=(0.5 + torch.rand(N, generator=gen)) if drawn["is_weights"] else None,
        log_q=0.2 * torch.randn(N, generator=gen) if drawn["log_q"] else None,
        sampling_logp=sampling if drawn["sampling"] else None,
        cu_seqlens=cu_of(lengths, torch.int32 if seed % 2 else torch.int64),
    )
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in problem.items()}


def padded_copy(problem: dict, lengths, token_advantages: bool) -> dict:
    """The same sequences as a padded [S, L] batch (no cu_seqlens)."""
    padded = {k: v for k, v in problem.items() if k != "cu_seqlens"}
    for name in ("hidden", "token_ids", "mask", *OPTIONAL):
        if problem[name] is not None:
            padded[name] = pad(problem[name], lengths)
    advantages = problem["advantages"].reshape(-1)
    padded["advantages"] = pad(advantages, lengths) if token_advantages else advantages
    return padded


def run(problem, config, backend, dtype, *, native=None, upstream=1.0):
    """The output and the gradients of hidden, weight and bias after backprop of loss * upstream;
    `native` True/False runs that path of the CPU backend (operator or PyTorch blocks)."""
    leaves = {
        k: None if problem[k] is None else problem[k].detach().to(dtype).clone().requires_grad_(True)
        for k in ("hidden", "weight", "bias")
    }
    kwargs = dict(bias=leaves["bias"], config=config, **{k: problem[k] for k in OPTIONAL})
    args = (leaves["hidden"], leaves["weight"], problem["token_ids"], problem["mask"], problem["advantages"])
    cu_seqlens = problem.get("cu_seqlens")
    if native is None:
        out = fused_linear_sage_loss(*args, cu_seqlens=cu_seqlens, backend=backend, **kwargs)
    elif cu_seqlens is None:
        out = cpu.sage_loss(validate_inputs(*args, **kwargs), config, native=native)
    else:
        inputs = validate_packed_inputs(*args, cu_seqlens=cu_seqlens, allowed_dtypes=FAST_DTYPES, **kwargs)
        out = rows_output(cpu.sage_loss(inputs, config, native=native), inputs, tuple(problem["token_ids"].shape))
    (out.loss * upstream).backward()
    return out, {k: None if v is None else v.grad for k, v in leaves.items()}


def check_packed_equals_padded(lengths, drawn, config, backend, dtype, *, native=None, seed=0):
    """The packed call on `make_packed(lengths, drawn, seed=seed)` against the padded call."""
    problem = make_packed(lengths, drawn, seed=seed)
    upstream = float(torch.empty(()).uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(seed)))
    out, grads = run(problem, config, backend, dtype, native=native, upstream=upstream)
    padded = padded_copy(problem, lengths, drawn["token_advantages"])
    ref, ref_grads = run(padded, config, backend, dtype, native=native, upstream=upstream)
    assert_close(out.loss, ref.loss, dtype, "loss", "loss")
    for name in PER_TOKEN:
        got = getattr(out, name)
        assert got.shape == problem["token_ids"].shape, name
        assert_close(got, unpad(getattr(ref, name), lengths), dtype, "token", name)
    for name in METRIC_NAMES:
        if bool(torch.isnan(ref.metrics[name])):
            assert bool(torch.isnan(out.metrics[name])), f"{name} must be NaN without tokens"
            continue
        assert_close(out.metrics[name], ref.metrics[name], dtype, "token", name)
    expected = dict(ref_grads, hidden=unpad(ref_grads["hidden"], lengths))
    for name, grad in grads.items():
        if grad is not None:
            assert grad.dtype == dtype and grad.shape == expected[name].shape
            assert_grad_close(grad, expected[name], dtype, f"grad {name}")
    assert bool((grads["hidden"][~problem["mask"].bool()] == 0).all()), "rows outside the loss get no gradient"


# ---------------------------------------------------------------- packed = padded, every backend


@pytest.mark.parametrize("loss_type", LOSS_TYPE_NAMES)
@settings(max_examples=5)
@given(lengths=lengths_strategy(), drawn=draws, seed=st.integers(0, 2**16))
def test_reference_packed_equals_padded(loss_type, lengths, drawn, seed):
    check_packed_equals_padded(lengths, drawn, config_for(loss_type, drawn), "reference", F64, seed=seed)


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("loss_type", LOSS_TYPE_NAMES)
@settings(max_examples=3, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=lengths_strategy(), drawn=draws, seed=st.integers(0, 2**16))
def test_cpu_packed_equals_padded(path, loss_type, lengths, drawn, seed):
    config = config_for(loss_type, drawn)
    check_packed_equals_padded(lengths, drawn, config, "cpu", torch.float32, native=path == "native", seed=seed)


#: the plain draw the Triton cases start from: on-policy-free grpo-style inputs, the default options.
BASE_DRAW = dict(
    beta=0.1,
    kl="k3",
    guide="branch",
    sequence_ratio=False,
    top_entropy_quantile=1.0,
    entropy_coef=0.0,
    off_policy_mask_threshold=None,
    use_bias_correction_kl=False,
    kl_clamp=None,
    temperature=1.0,
    logit_softcap=None,
    logit_scale=1.0,
    gamma=0.3,
    tau=1.2,
    eps_high=0.2,
    sapo_temperature_neg=1.05,
    vespo_lambda_pos=3.0,
    delta_clip=None,
    dual_clip_c=None,
    max_completion_length=None,
    num_items_in_batch=None,
    old=True,
    ref=True,
    is_weights=False,
    log_q=False,
    sampling=False,
    bias=True,
    token_advantages=False,
)
#: the Triton interpreter is slow: one packing per loss type, between them reaching both of its
#: paths (three-matmul: token-local configurations; two-pass: the others) and every option.
TRITON_CASES = {
    "grpo": ([3, 0, 6, 2], dict(delta_clip=1.3, dual_clip_c=2.5)),
    "bnpo": ([5, 1], dict(sequence_ratio=True, is_weights=True, use_bias_correction_kl=True)),
    "dr_grpo": ([0, 4, 4, 7], dict(logit_softcap=2.5, bias=False, kl="k1")),
    "dapo": (
        [7, 2, 0],
        dict(top_entropy_quantile=0.6, entropy_coef=0.05, token_advantages=True, num_items_in_batch=7.0),
    ),
    "cispo": ([2, 3, 4], dict(log_q=True, sampling=True, off_policy_mask_threshold=0.02)),
    "sapo": ([1, 6], dict(kl="k2", temperature=0.7, kl_clamp=0.5, sapo_temperature_neg=0.7, logit_scale=1.6)),
    "luspo": ([4, 0, 0, 5], dict(sequence_ratio=True, guide="none")),
    "vespo": ([6, 3, 1], dict(is_weights=True, kl="fk3", vespo_lambda_pos=1.5, gamma=1.0, tau=0.5)),
    "gmpo": ([2, 5, 3], dict(is_weights=True, entropy_coef=0.05, max_completion_length=9)),
}


@pytest.mark.parametrize("loss_type", LOSS_TYPE_NAMES)
def test_triton_packed_equals_padded(loss_type):
    lengths, overrides = TRITON_CASES.get(loss_type, ([3, 0, 5], {}))
    drawn = {**BASE_DRAW, **overrides}
    config = config_for(loss_type, drawn)
    check_packed_equals_padded(lengths, drawn, config, "triton", torch.float32, seed=len(loss_type))


# ---------------------------------------------------------------- layouts, scoring, refusals


def small_problem(lengths=(3, 0, 4, 1), D=8, V=31, seed=5):
    drawn = dict(BASE_DRAW, is_weights=True, sampling=True, log_q=True)
    return make_packed(list(lengths), drawn, D=D, V=V, seed=seed)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_leading_one_forms_and_per_sequence_column(backend):
    # [1, N, D] hidden, [1, N] per-token tensors and [S, 1] advantages mean what [N, D], [N], [S] do
    problem = small_problem()
    config = LossConfig(loss_type="dapo", importance_sampling="sequence")
    flat, flat_grads = run(problem, config, backend, torch.float32)
    rows = dict(problem, hidden=problem["hidden"][None], advantages=problem["advantages"][:, None])
    for name in ("token_ids", "mask", *OPTIONAL):
        rows[name] = problem[name][None]
    out, grads = run(rows, config, backend, torch.float32)
    assert out.logp.shape == (1, sum((3, 0, 4, 1)))
    torch.testing.assert_close(out.loss, flat.loss)
    for name in PER_TOKEN:
        torch.testing.assert_close(getattr(out, name)[0], getattr(flat, name))
    torch.testing.assert_close(grads["hidden"][0], flat_grads["hidden"])
    torch.testing.assert_close(grads["weight"], flat_grads["weight"])


def test_per_token_advantages_as_a_row():
    problem = small_problem()
    per_token = torch.randn(8, generator=torch.Generator().manual_seed(1))
    config = LossConfig(loss_type="bnpo")
    flat, _ = run(dict(problem, advantages=per_token), config, "reference", F64)
    row, _ = run(dict(problem, advantages=per_token[None]), config, "reference", F64)
    torch.testing.assert_close(row.loss, flat.loss)
    by_sequence, _ = run(problem, config, "reference", F64)
    assert not torch.allclose(by_sequence.loss, flat.loss)  # the two readings differ on these inputs


def test_scoring_takes_the_packed_layout():
    problem = small_problem()
    hidden, weight, ids = problem["hidden"].float(), problem["weight"].float(), problem["token_ids"].clamp(max=30)
    expected = logprobs_and_entropy(hidden, weight, ids)
    packed = logprobs_and_entropy(hidden[None], weight, ids[None], cu_seqlens=problem["cu_seqlens"])
    assert packed[0].shape == (1, 8)
    for got, want in zip(packed, expected):
        torch.testing.assert_close(got[0], want)
    with pytest.raises(ValueError, match=r"^cu_seqlens must start at 0 and end at N = 8"):
        logprobs_and_entropy(hidden, weight, ids, cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match=r"^token_ids must have shape \[N\] or \[1, N\]"):
        logprobs_and_entropy(hidden, weight, ids.view(2, 4), cu_seqlens=problem["cu_seqlens"])


META = torch.device("meta")
N_SMALL = 8  # tokens of `small_problem`: lengths 3, 0, 4, 1


@pytest.mark.parametrize(
    "changes, error, words",
    [
        ({"cu_seqlens": torch.tensor([0, 4, 3, 7, 8])}, ValueError, "cu_seqlens must be non-decreasing, got 4 then 3"),
        ({"cu_seqlens": torch.tensor([1, 3, 3, 7, 8])}, ValueError, "cu_seqlens must start at 0 and end at N = 8"),
        ({"cu_seqlens": torch.tensor([0, 3, 3, 7, 7])}, ValueError, "cu_seqlens must start at 0 and end at N = 8"),
        ({"cu_seqlens": torch.tensor([0, 3, 9, 7, 8])}, ValueError, "cu_seqlens must stay within [0, N=8], got 9"),
        ({"cu_seqlens": torch.tensor([0.0, 3, 3, 7, 8])}, TypeError, "cu_seqlens must have dtype int32 or int64"),
        ({"cu_seqlens": torch.tensor([0, 3, 3, 7, 8], device=META)}, ValueError, "cu_seqlens must be on cpu"),
        ({"cu_seqlens": torch.tensor([[0, 3, 3, 7, 8]])}, ValueError, "cu_seqlens must have 1 dimensions"),
        ({"cu_seqlens": torch.tensor([0])}, ValueError, "cu_seqlens must have S + 1 >= 2 entries"),
        ({"cu_seqlens": [0, 3, 3, 7, 8]}, TypeError, "cu_seqlens must be a torch.Tensor"),
        (
            {"advantages": torch.randn(5)},
            ValueError,
            "advantages must have shape [S=4] (or [S, 1]) per sequence or [N=8]",
        ),
        ({"advantages": torch.randn(2, 4)}, ValueError, "advantages must have shape [S=4]"),
        ({"token_ids": torch.zeros(2, 4, dtype=torch.long)}, ValueError, "token_ids must have shape [N] or [1, N]"),
        ({"hidden": torch.randn(9, 8)}, ValueError, "hidden must have shape [N=8, D] or [1, N=8, D]"),
        ({"mask": torch.ones(7, dtype=torch.bool)}, ValueError, "mask must have shape [N=8] or [1, N=8]"),
        ({"old_logp": torch.zeros(2, 4)}, ValueError, "old_logp must have shape [N=8] or [1, N=8]"),
        ({"token_ids": torch.zeros(8)}, TypeError, "token_ids must be an integer tensor"),
        ({"loss_type": "luspo", "luspo_include_padding": True}, ValueError, "luspo_include_padding must be False"),
    ],
    ids=lambda value: None,
)
def test_bad_packed_input_raises_naming_the_argument(changes, error, words):
    problem = small_problem()
    options = {k: changes.pop(k) for k in list(changes) if k in ("loss_type", "luspo_include_padding")}
    problem.update(changes)
    args = [problem.pop(k) for k in ("hidden", "weight", "token_ids", "mask", "advantages")]
    with pytest.raises(error, match="^" + re.escape(words)):
        fused_linear_sage_loss(*args, backend="reference", **problem, **options)


def test_ambiguous_one_dimensional_advantages_are_refused():
    # S = N = 3 with an empty sequence: [3] could be per sequence or per token
    problem = make_packed([2, 0, 1], dict(BASE_DRAW), seed=2)
    problem["advantages"] = torch.randn(3)
    args = [problem.pop(k) for k in ("hidden", "weight", "token_ids", "mask", "advantages")]
    with pytest.raises(ValueError, match=r"^advantages of shape \(3,\) is ambiguous"):
        fused_linear_sage_loss(*args, backend="reference", **problem)


# ---------------------------------------------------------------- memory and the Triton operators

#: one long sequence and several short ones: the padded grid has S * L = 512 cells for N = 78 tokens.
SKEWED = [64] + [2] * 7
SKEWED_D, SKEWED_V = 40, 400
#: a padded copy of hidden (or of its gradient) has S L D elements; the [N, V] logits have more.
PADDED_HIDDEN = len(SKEWED) * max(SKEWED) * SKEWED_D
CONFIGS = {"token-local": {}, "sequence-ratio": dict(importance_sampling="sequence", top_entropy_quantile=0.5)}


def skewed_problem():
    assert sum(SKEWED) * SKEWED_V > PADDED_HIDDEN > SKEWED_V * SKEWED_D  # the limit catches logits, not the head
    drawn = dict(BASE_DRAW, is_weights=True)
    problem = make_packed(SKEWED, drawn, D=SKEWED_D, V=SKEWED_V, seed=9)
    return {k: v.float() if isinstance(v, torch.Tensor) and v.dtype == F64 else v for k, v in problem.items()}


def leaves_and_rest(problem):
    leaves = {k: problem[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    return leaves, {k: v for k, v in problem.items() if k not in leaves}


@pytest.mark.parametrize("options", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("path", ["native", "torch"])
def test_cpu_makes_no_padded_copy(path, options, monkeypatch):
    monkeypatch.setenv("SAGE_CPU_NATIVE", "1" if path == "native" else "0")
    leaves, rest = leaves_and_rest(skewed_problem())
    with AllocationRecorder(PADDED_HIDDEN) as recorder:
        fused_linear_sage_loss(**leaves, **rest, backend="cpu", **options).loss.backward()
    recorder.check()
    assert all(leaf.grad is not None for leaf in leaves.values())
    # the same sequences padded: the hidden gradient alone is [S, L, D], which the recorder catches
    padded = padded_copy(skewed_problem(), SKEWED, token_advantages=False)
    leaves, rest = leaves_and_rest(padded)
    with AllocationRecorder(PADDED_HIDDEN) as recorder:
        fused_linear_sage_loss(**leaves, **rest, backend="cpu", **options).loss.backward()
    with pytest.raises(AssertionError, match="elements was allocated"):
        recorder.check()


@pytest.mark.parametrize("options", CONFIGS.values(), ids=CONFIGS.keys())
def test_triton_makes_no_padded_copy(options, monkeypatch):
    # inside the operators (a dispatch mode sees an operator as one call): their bodies, as
    # triton/test_triton_memory.py calls them
    from triton_harness import KernelMemoryRecorder

    from sage_kernels.triton import boundary, ops, ops_three_matmul, tiles

    monkeypatch.setitem(tiles.TILE_OVERRIDE, "chunk_n", 32)  # three chunks: the interpreter runs fewer stages

    problem = skewed_problem()  # no leaves: the operators' bodies form the gradients they are told to
    config = LossConfig(**options)
    inputs = validate_packed_inputs(
        problem["hidden"],
        problem["weight"],
        problem["token_ids"],
        problem["mask"],
        problem["advantages"],
        bias=problem["bias"],
        cu_seqlens=problem["cu_seqlens"],
        config=config,
        allowed_dtypes=FAST_DTYPES,
        **{k: problem[k] for k in OPTIONAL},
    )
    with KernelMemoryRecorder(PADDED_HIDDEN) as recorder:
        tensors = boundary.LossTensors.of(inputs)
        if three_matmul.exact_for(config):
            grads = ops_three_matmul.local_forward(tensors, config, boundary.GradsWanted(True, True, True))[-3:]
        else:
            out = ops.loss_forward(tensors, config)
            flags = boundary.BackwardFlags.of(config, need_hidden=True, need_weight=True, need_bias=True)
            grads = ops.loss_backward(torch.tensor(1.5), boundary.TwoPassSaved.of(tensors, out), flags)
    recorder.check()
    assert all(bool(torch.isfinite(grad).all()) for grad in grads)


@pytest.mark.parametrize("options", CONFIGS.values(), ids=CONFIGS.keys())
def test_triton_operators_pass_opcheck_on_packed_sequences(options):
    from sage_kernels.triton import boundary

    problem = small_problem()
    config = LossConfig(entropy_coef=0.01, **options)
    inputs = validate_packed_inputs(
        problem["hidden"].float().requires_grad_(),
        problem["weight"].float().requires_grad_(),
        problem["token_ids"],
        problem["mask"],
        problem["advantages"],
        cu_seqlens=problem["cu_seqlens"],
        config=config,
        allowed_dtypes=FAST_DTYPES,
        **{k: problem[k] for k in OPTIONAL},
    )
    floats, ints, num_items = boundary.pack_config(config)
    args = (*boundary.LossTensors.of(inputs).flat(), num_items, floats, ints)
    if three_matmul.exact_for(config):
        op, args = torch.ops.sage_kernels.triton_sage_loss_local.default, (*args, [True, True, False])
    else:
        op = torch.ops.sage_kernels.triton_sage_loss.default
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
