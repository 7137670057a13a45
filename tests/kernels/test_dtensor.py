"""DTensor arguments (FSDP2's sharded LM head, a tensor-parallel hidden) on two CPU ranks (gloo).

`fused_linear_sage_loss` and `logprobs_and_entropy` gather each DTensor argument whole once per call
and send its gradient back to the shards as the mean over the ranks (FSDP2's and DDP's data-parallel
mean). Each rank also runs the same call on plain tensors; the test compares the two: the loss and
per-token outputs are those of the whole weight (never of this rank's shard), the weight's gradient
is the ranks' mean, and the collectives counted (`CommDebugMode`) are one all-gather per DTensor in
the forward and one reduce-scatter per DTensor in the backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sage_kernels import LossConfig, fused_linear_sage_loss, logprobs_and_entropy

WORLD, B, L, D, V = 2, 3, 5, 16, 37  # V odd: the shards are uneven
UPSTREAM = 0.7  # the loss's upstream gradient: not 1, so a gradient that ignores it fails
CONFIG = LossConfig(guide="branch", tau=0.8, beta=0.04, temperature=0.9)


def batch(seed: int) -> dict:
    """A batch of the loss's inputs (no LM head); `seed` picks whose."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, L, generator=g) > 0.25
    mask[0, 0] = True
    return dict(
        hidden=torch.randn(B, L, D, generator=g),
        token_ids=torch.randint(0, V, (B, L), generator=g),
        mask=mask,
        advantages=torch.randn(B, generator=g),
        old_logp=-torch.rand(B, L, generator=g) * 3,
        ref_logp=-torch.rand(B, L, generator=g) * 3,
    )


def head() -> tuple[torch.Tensor, torch.Tensor]:
    """The whole LM head (weight, bias), the same on every rank."""
    g = torch.Generator().manual_seed(100)
    return torch.randn(V, D, generator=g) * 0.4, torch.randn(V, generator=g) * 0.5


def _loss(hidden, weight, bias, inputs) -> dict:
    """The loss called with these tensors (plain or DTensor leaves), backward run; outputs and gradients
    (a DTensor's as a DTensor)."""
    out = fused_linear_sage_loss(hidden, weight, bias=bias, config=CONFIG, backend="cpu", **inputs)
    (out.loss * UPSTREAM).backward()
    grads = dict(grad_hidden=hidden.grad, grad_weight=weight.grad, grad_bias=bias.grad)
    return dict(loss=out.loss.detach(), logp=out.logp, entropy=out.entropy, **grads)


def _whole(results: dict) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in results.items()}


def _counted(call) -> tuple[object, dict]:
    """`call()`'s result and the collectives it ran, by name."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        result = call()
    return result, {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_(True)


def _sharded(t: torch.Tensor, mesh, placement) -> torch.Tensor:
    """The DTensor leaf of the whole tensor `t` (the same on every rank) laid out by `placement`."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t, mesh, [placement]).requires_grad_(True)


def _rank_main(rank: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    weight, bias = head()
    results = {}

    # FSDP2: the head sharded by rows, each rank its own batch (plain hidden)
    inputs = batch(rank)
    hidden = inputs.pop("hidden")
    results["fsdp_plain"] = _loss(leaf(hidden), leaf(weight), leaf(bias), inputs)
    w, b = _sharded(weight, mesh, Shard(0)), _sharded(bias, mesh, Shard(0))
    fsdp, results["fsdp_comm"] = _counted(lambda: _loss(leaf(hidden), w, b, inputs))
    results["fsdp"] = _whole(fsdp)
    results["fsdp_shard_rows"] = w.to_local().shape[0]

    # tensor parallel: the same batch on both ranks, hidden a DTensor too (sharded and replicated)
    inputs = batch(10)
    hidden = inputs.pop("hidden")
    results["tp_plain"] = _loss(leaf(hidden), leaf(weight), leaf(bias), inputs)
    for name, placement in (("tp_shard", Shard(1)), ("tp_replicate", Replicate())):
        h, w = _sharded(hidden, mesh, placement), _sharded(weight, mesh, Shard(0))
        results[name] = _whole(_loss(h, w, leaf(bias), inputs))

    # scoring: a DTensor weight and hidden give the whole head's log-probs and entropies
    scoring = dict(temperature=0.9, backend="cpu")
    results["scoring_plain"] = logprobs_and_entropy(hidden, weight, inputs["token_ids"], bias=bias, **scoring)
    h, w = _sharded(hidden, mesh, Shard(0)).detach(), _sharded(weight, mesh, Shard(0)).detach()
    results["scoring"], results["scoring_comm"] = _counted(
        lambda: logprobs_and_entropy(h, w, inputs["token_ids"], bias=bias, **scoring)
    )

    # a data-parallel hidden (each rank's own rows) gathered is the whole batch's: not this rank's token_ids'
    own_rows = DTensor.from_local(batch(rank)["hidden"], mesh, [Shard(0)])
    try:
        fused_linear_sage_loss(own_rows, weight, config=CONFIG, **inputs)
        results["mismatch"] = "no error"
    except ValueError as error:
        results["mismatch"] = str(error)
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dtensor")
    mp.start_processes(_rank_main, args=(str(out / "init"), str(out)), nprocs=WORLD, start_method="spawn")
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


def test_fsdp_sharded_head_is_gathered_once_and_its_gradient_averaged(ranks):
    mean = {name: sum(r["fsdp_plain"][name] for r in ranks) / WORLD for name in ("grad_weight", "grad_bias")}
    for rank, results in enumerate(ranks):
        assert results["fsdp_shard_rows"] < V  # each rank held a shard only
        got, plain = results["fsdp"], results["fsdp_plain"]
        for name in ("loss", "logp", "entropy", "grad_hidden"):  # this rank's own loss, of the whole head
            torch.testing.assert_close(got[name], plain[name], rtol=0, atol=0, msg=lambda m: f"rank {rank} {name}: {m}")
        for name in ("grad_weight", "grad_bias"):  # the ranks' mean, as FSDP2 reduces a gradient
            torch.testing.assert_close(got[name], mean[name], msg=lambda m: f"rank {rank} {name}: {m}")
        # one all-gather per DTensor (weight, bias) in the forward, one reduce-scatter each in the backward
        assert results["fsdp_comm"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, results["fsdp_comm"]


@pytest.mark.parametrize("layout", ["tp_shard", "tp_replicate"])
def test_tensor_parallel_hidden_and_head_equal_the_plain_call(ranks, layout):
    for rank, results in enumerate(ranks):
        got, plain = results[layout], results["tp_plain"]
        for name in ("loss", "logp", "entropy", "grad_hidden", "grad_weight", "grad_bias"):
            torch.testing.assert_close(got[name], plain[name], msg=lambda m: f"rank {rank} {name}: {m}")


def test_scoring_gathers_the_head_once(ranks):
    for results in ranks:
        for got, plain in zip(results["scoring"], results["scoring_plain"]):
            torch.testing.assert_close(got, plain, rtol=0, atol=0)
        assert results["scoring_comm"] == {"all_gather_into_tensor": 2}, results["scoring_comm"]


def test_a_data_parallel_hidden_gathered_is_refused_by_name(ranks):
    for results in ranks:
        assert results["mismatch"].startswith(f"hidden must have shape [B={B}, L={L}, D]"), results["mismatch"]
