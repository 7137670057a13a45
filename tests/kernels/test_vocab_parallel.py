"""The vocabulary-parallel head on two CPU ranks (gloo) against the unsharded float64 reference.

Both ranks run every case once (`sharded_runs`, one spawn for the module) and save what they
computed; each test compares one case with `fused_linear_sage_loss` / `logprobs_and_entropy` on
the whole LM head in float64, at the tolerances of `tolerances.py` for the sharded run's dtype:
the loss, the per-token outputs and the gradients of hidden, each rank's weight shard and bias.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tolerances import assert_close, assert_grad_close

from sage_kernels import (
    LossConfig,
    fused_linear_sage_loss,
    logprobs_and_entropy,
    vocab_parallel_logprobs_and_entropy,
    vocab_parallel_sage_loss,
)
from sage_kernels.integrations import verl as sage_verl
from sage_kernels.reference import reference_logprobs_and_entropy

TP, V_SHARD, B, L, D = 2, 19, 3, 6, 16
V = TP * V_SHARD
UPSTREAM = 0.7  # the loss's upstream gradient: not 1, so a gradient that ignores it fails
CASES = {
    "branch-grpo-kl-bias-temperature": dict(
        config=LossConfig(guide="branch", tau=0.8, beta=0.04, temperature=0.8), bias=True, is_weights=False
    ),
    "vespo-is-weights-entropy-bonus": dict(
        config=LossConfig(guide="none", loss_type="vespo", beta=0.0, entropy_coef=0.01), bias=False, is_weights=True
    ),
    "luspo-include-padding": dict(
        config=LossConfig(guide="branch", tau=0.8, beta=0.04, loss_type="luspo", luspo_include_padding=True),
        bias=True,
        is_weights=False,
    ),
    "gspo-dapo-entropy-quantile": dict(
        config=LossConfig(
            guide="branch",
            tau=0.8,
            beta=0.04,
            loss_type="dapo",
            importance_sampling="sequence",
            top_entropy_quantile=0.6,
            entropy_coef=-0.005,
        ),
        bias=True,
        is_weights=False,
    ),
}
RUNS = [("reference", torch.float64), ("reference", torch.float32), ("cpu", torch.float32), ("cpu", torch.bfloat16)]
RUNS += [("triton", torch.float32)]  # the Triton interpreter on CPU (conftest sets TRITON_INTERPRET=1)
RUN_IDS = [f"{backend}-{str(dtype).removeprefix('torch.')}" for backend, dtype in RUNS]


def case_inputs(case: str, dtype: torch.dtype) -> dict:
    """The whole (unsharded) inputs of `case`, rounded to `dtype`; the same on every rank."""
    g = torch.Generator().manual_seed(sorted(CASES).index(case))
    mask = torch.rand(B, L, generator=g) > 0.25
    mask[1] = False  # a row without any completion token
    mask[0, 0] = True
    token_ids = torch.randint(0, V, (B, L), generator=g)
    token_ids[0, :2] = torch.tensor([3, V_SHARD + 2])  # targets on both shards
    if not CASES[case]["config"].luspo_include_padding:  # which reads every position
        token_ids = torch.where(mask, token_ids, -100)  # masked ids are never read
    hidden = torch.randn(B, L, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.4
    spec = CASES[case]
    inputs = dict(
        hidden=hidden.to(dtype),
        weight=weight.to(dtype),
        token_ids=token_ids,
        mask=mask,
        advantages=torch.randn(B, generator=g),
        bias=(torch.randn(V, generator=g) * 0.5).to(dtype) if spec["bias"] else None,
        old_logp=-torch.rand(B, L, generator=g) * 3,
        ref_logp=-torch.rand(B, L, generator=g) * 3,
        is_weights=torch.rand(B, L, generator=g) + 0.5 if spec["is_weights"] else None,
    )
    return inputs


def scoring_inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(11)
    return (
        torch.randn(B, L, D, generator=g).to(dtype),
        (torch.randn(V, D, generator=g) * 0.4).to(dtype),
        torch.randint(0, V, (B, L), generator=g),
        torch.randn(B, L, generator=g),  # upstream gradients of logp and entropy (the verl path)
        torch.randn(B, L, generator=g),
    )


def shard(t: torch.Tensor | None, rank: int) -> torch.Tensor | None:
    return None if t is None else t[rank * V_SHARD : (rank + 1) * V_SHARD]


def leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone().requires_grad_(True)


def _sharded_loss(rank: int, case: str, backend: str, dtype: torch.dtype) -> dict:
    inputs = case_inputs(case, dtype)
    hidden, weight = leaf(inputs.pop("hidden")), leaf(shard(inputs.pop("weight"), rank))
    bias = leaf(shard(inputs.pop("bias"), rank))
    out = vocab_parallel_sage_loss(
        hidden, weight, group=dist.group.WORLD, bias=bias, config=CASES[case]["config"], backend=backend, **inputs
    )
    (out.loss * UPSTREAM).backward()
    return dict(
        loss=out.loss.detach(),
        logp=out.logp,
        entropy=out.entropy,
        q=out.q,
        kl=out.kl,
        ratio=out.ratio,
        metrics=out.metrics,
        grad_hidden=hidden.grad,
        grad_weight=weight.grad,
        grad_bias=None if bias is None else bias.grad,
    )


def _sharded_scoring(rank: int, backend: str, dtype: torch.dtype) -> dict:
    hidden, weight, labels, up_logp, up_entropy = scoring_inputs(dtype)
    logp, entropy = vocab_parallel_logprobs_and_entropy(
        hidden, shard(weight, rank), labels, group=dist.group.WORLD, temperature=0.9, backend=backend
    )
    hidden, weight = leaf(hidden), leaf(shard(weight, rank))
    verl_logp, verl_entropy = sage_verl.linear_cross_entropy(
        hidden, weight, labels, 0.9, "none", dist.group.WORLD, backend=backend
    )
    ((verl_logp * up_logp).sum() + (verl_entropy * up_entropy).sum()).backward()
    return dict(
        logp=logp,
        entropy=entropy,
        verl_logp=verl_logp.detach(),
        verl_entropy=verl_entropy.detach(),
        verl_grad_hidden=hidden.grad,
        verl_grad_weight=weight.grad,
    )


def _error(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "no error"


def _bad_inputs(rank: int) -> dict:
    inputs = case_inputs(sorted(CASES)[0], torch.float32)
    hidden, weight, bias = inputs.pop("hidden"), inputs.pop("weight"), inputs.pop("bias")

    def loss(weight_shard, **changes):
        args = {**inputs, **changes}
        return vocab_parallel_sage_loss(hidden, weight_shard, group=dist.group.WORLD, backend="cpu", **args)

    ids_over, ids_under = inputs["token_ids"].clone(), inputs["token_ids"].clone()
    ids_over[0, 0], ids_under[0, 0] = V, -1
    return dict(
        unequal_shards=_error(lambda: loss(weight[: V_SHARD - rank])),
        id_over=_error(lambda: loss(shard(weight, rank), token_ids=ids_over)),
        id_under=_error(lambda: loss(shard(weight, rank), token_ids=ids_under)),
        scoring_id_over=_error(
            lambda: vocab_parallel_logprobs_and_entropy(
                hidden, shard(weight, rank), ids_over.clamp(min=0), group=dist.group.WORLD
            )
        ),
        no_group=_error(lambda: vocab_parallel_sage_loss(hidden, shard(weight, rank), group=None, **inputs)),
        bias_shape=_error(lambda: loss(shard(weight, rank), bias=bias)),
    )


def _all_masked(rank: int) -> dict:
    inputs = case_inputs(sorted(CASES)[0], torch.float32)
    hidden, weight = leaf(inputs.pop("hidden")), leaf(shard(inputs.pop("weight"), rank))
    bias = leaf(shard(inputs.pop("bias"), rank))
    inputs["mask"] = torch.zeros_like(inputs["mask"])
    out = vocab_parallel_sage_loss(hidden, weight, group=dist.group.WORLD, bias=bias, backend="cpu", **inputs)
    (out.loss * UPSTREAM).backward()
    return dict(loss=out.loss.detach(), grad_hidden=hidden.grad, grad_weight=weight.grad, grad_bias=bias.grad)


def _second_derivative_error(rank: int, backend: str) -> str:
    """A gradient penalty on a layer below the sharded head: the error it raises, or "no error"."""
    inputs = case_inputs(sorted(CASES)[0], torch.float64 if backend == "reference" else torch.float32)
    proj = torch.eye(D, dtype=inputs["hidden"].dtype).requires_grad_(True)
    hidden = torch.tanh(inputs.pop("hidden") @ proj)
    weight, bias = shard(inputs.pop("weight"), rank), shard(inputs.pop("bias"), rank)
    out = vocab_parallel_sage_loss(hidden, weight, group=dist.group.WORLD, bias=bias, backend=backend, **inputs)
    try:
        (grad_proj,) = torch.autograd.grad(out.loss, (proj,), create_graph=True)
        torch.autograd.grad(grad_proj.square().sum(), (proj,))
    except RuntimeError as error:
        return str(error)
    return "no error"


def _rank_main(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)
    results = {
        "loss": {(case, run): _sharded_loss(rank, case, *run) for case in CASES for run in RUNS},
        "scoring": {run: _sharded_scoring(rank, *run) for run in RUNS},
        "errors": _bad_inputs(rank),
        "all_masked": _all_masked(rank),
        "second_derivative": {backend: _second_derivative_error(rank, backend) for backend in ("reference", "cpu")},
    }
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """Each rank's results: [rank]["loss"][(case, (backend, dtype))], ["scoring"][run], ["errors"]."""
    out = tmp_path_factory.mktemp("vocab-parallel")
    mp.start_processes(_rank_main, args=(str(out / "init"), str(out)), nprocs=TP, start_method="spawn")
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(TP)]


def unsharded_loss(case: str, dtype: torch.dtype) -> dict:
    inputs = {
        k: v.double() if k in ("hidden", "weight", "bias") and v is not None else v
        for k, v in case_inputs(case, dtype).items()
    }
    hidden, weight, bias = leaf(inputs.pop("hidden")), leaf(inputs.pop("weight")), leaf(inputs.pop("bias"))
    out = fused_linear_sage_loss(hidden, weight, bias=bias, config=CASES[case]["config"], backend="reference", **inputs)
    (out.loss * UPSTREAM).backward()
    return dict(
        out=out, grad_hidden=hidden.grad, grad_weight=weight.grad, grad_bias=None if bias is None else bias.grad
    )


@pytest.mark.parametrize("run", RUNS, ids=RUN_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_loss_equals_unsharded(sharded_runs, case, run):
    dtype = run[1]
    want = unsharded_loss(case, dtype)
    for rank, results in enumerate(sharded_runs):
        got = results["loss"][(case, run)]
        what = f"{case} {run[0]} rank {rank}"
        assert_close(got["loss"], want["out"].loss.detach(), dtype, "loss", f"{what} loss")
        for name in ("logp", "entropy", "q", "kl", "ratio"):
            assert_close(got[name], getattr(want["out"], name), dtype, "token", f"{what} {name}")
        for name, value in want["out"].metrics.items():
            assert_close(got["metrics"][name], value, dtype, "token", f"{what} {name}")
        assert_grad_close(got["grad_hidden"], want["grad_hidden"], dtype, f"{what} grad hidden")
        assert_grad_close(got["grad_weight"], shard(want["grad_weight"], rank), dtype, f"{what} grad weight shard")
        if want["grad_bias"] is not None:
            assert_grad_close(got["grad_bias"], shard(want["grad_bias"], rank), dtype, f"{what} grad bias shard")
        if not CASES[case]["config"].luspo_include_padding:
            assert not got["grad_hidden"][1].any()  # the row without tokens gets no gradient


@pytest.mark.parametrize("run", RUNS, ids=RUN_IDS)
def test_sharded_scoring_and_verl_kernel_equal_unsharded(sharded_runs, run):
    dtype = run[1]
    hidden, weight, labels, up_logp, up_entropy = scoring_inputs(dtype)
    logp, entropy = logprobs_and_entropy(hidden.double(), weight.double(), labels, temperature=0.9, backend="reference")
    hidden, weight = leaf(hidden.double()), leaf(weight.double())
    # the oracle's autograd in float64 (the adapter's own unsharded backward computes in float32)
    flat_logp, flat_entropy = reference_logprobs_and_entropy(
        hidden.view(-1, D), weight, labels.view(-1), temperature=0.9, dtype=torch.float64
    )
    ((flat_logp * up_logp.view(-1)).sum() + (flat_entropy * up_entropy.view(-1)).sum()).backward()
    grad_hidden_parts = []
    for rank, results in enumerate(sharded_runs):
        got = results["scoring"][run]
        for name, value, expected in (
            ("logp", got["logp"], logp),
            ("entropy", got["entropy"], entropy),
            ("verl logp", got["verl_logp"], logp),
            ("verl entropy", got["verl_entropy"], entropy),
        ):
            assert_close(value, expected, dtype, "token", f"{run[0]} rank {rank} {name}")
        assert_grad_close(got["verl_grad_weight"], shard(weight.grad, rank), dtype, f"rank {rank} verl grad weight")
        grad_hidden_parts.append(got["verl_grad_hidden"])
    # verl's convention: each rank's hidden gradient is its shard's share, summed by the caller
    assert_grad_close(sum(p.double() for p in grad_hidden_parts), hidden.grad, dtype, "verl grad hidden (summed)")
    for rank, part in enumerate(grad_hidden_parts):
        share = ((part.double() - hidden.grad).abs().max() / hidden.grad.abs().max()).item()
        assert share > 0.05, f"rank {rank}'s hidden gradient is the whole one, not its shard's share"


@pytest.mark.parametrize(
    "name, argument",
    [
        ("unequal_shards", "weight"),
        ("id_over", "token_ids"),
        ("id_under", "token_ids"),
        ("scoring_id_over", "token_ids"),
        ("no_group", "group"),
        ("bias_shape", "bias"),
    ],
)
def test_bad_input_names_the_argument(sharded_runs, name, argument):
    for results in sharded_runs:
        message = results["errors"][name]
        assert message.startswith(argument + " must"), message


def test_a_batch_without_tokens_has_zero_loss_and_gradients(sharded_runs):
    for results in sharded_runs:
        got = results["all_masked"]
        assert got["loss"].item() == 0.0
        assert not got["grad_hidden"].any() and not got["grad_weight"].any() and not got["grad_bias"].any()


def test_a_second_derivative_through_the_sharded_head_raises(sharded_runs):
    """Each rank differentiates through its own shard with the others' statistics as constants:
    exact for the gradient, not for its derivative, on any backend (the reference's too)."""
    for results in sharded_runs:
        for backend, message in results["second_derivative"].items():
            assert "vocabulary-parallel head are not differentiable" in message, (backend, message)
            assert "unsharded loss with backend='reference'" in message, (backend, message)
