"""The Triton backend's torch.library operators: schema, fake (meta) implementations, autograd
registration, and tracing by torch.compile.

On CPU the compiled run uses the "aot_eager" backend (graph capture and AOT autograd
through the fake implementations, no C++ toolchain needed); on CUDA, inductor.
"""

from __future__ import annotations

import pytest
import torch
from parity import DEVICE, make_problem
from triton_harness import loss_op_args

from sage_kernels import LossConfig, fused_linear_sage_loss
from sage_kernels.triton import boundary

COMPILE_BACKEND = "inductor" if DEVICE.type == "cuda" else "aot_eager"


def test_config_round_trips_through_the_operator_arguments():
    config = LossConfig(
        kl="k2",
        guide="none",
        loss_type="dr_grpo",
        importance_sampling="sequence",
        delta_clip=2.0,
        dual_clip_c=3.0,
        max_completion_length=77,
        num_items_in_batch=12.0,
        beta=0.0,
        tau=0.9,
    )
    assert boundary.unpack_config(*boundary.pack_config(config)) == config
    padded = LossConfig(loss_type="luspo", luspo_include_padding=True)
    assert boundary.unpack_config(*boundary.pack_config(padded)) == padded
    n = torch.tensor(5.0)
    assert boundary.unpack_config(*boundary.pack_config(LossConfig(num_items_in_batch=n))).num_items_in_batch is n


def test_opcheck_loss_operator():
    problem = make_problem(B=2, L=5, V=200, D=32, seed=1)
    args = loss_op_args(problem, LossConfig(entropy_coef=0.01))
    torch.library.opcheck(
        torch.ops.sage_kernels.triton_sage_loss.default,
        args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def test_opcheck_scoring_operator():
    problem = make_problem(B=2, L=5, V=200, D=32, seed=2)
    args = (
        problem["hidden"].reshape(10, 32),
        problem["weight"],
        problem["bias"],
        problem["token_ids"].reshape(10),
        0.4,  # logit_inner, logit_outer, softcap: a softcap of 2.5 at T = 0.8 and scale 1
        3.125,
        True,
    )
    torch.library.opcheck(
        torch.ops.sage_kernels.triton_logprobs_entropy.default, args, test_utils=("test_schema", "test_faketensor")
    )


class TinyPolicyHead(torch.nn.Module):
    """A projection then the fused loss over an LM head: what a training step compiles."""

    def __init__(self, D, V):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, V)

    def forward(self, hidden, token_ids, mask, advantages, ref_logp):
        out = fused_linear_sage_loss(
            torch.tanh(self.proj(hidden)),
            self.head.weight,
            token_ids,
            mask,
            advantages,
            bias=self.head.bias,
            ref_logp=ref_logp,
            backend="triton",
            entropy_coef=0.01,
        )
        return out.loss, out.entropy


def test_torch_compile_traces_a_model_that_calls_the_loss():
    problem = make_problem(B=2, L=6, V=300, D=32, seed=4)
    torch.manual_seed(0)
    model = TinyPolicyHead(32, 300).to(DEVICE)
    args = tuple(problem[k] for k in ("hidden", "token_ids", "mask", "advantages", "ref_logp"))

    loss, entropy = model(*args)
    loss.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    compiled = torch.compile(model, backend=COMPILE_BACKEND)
    c_loss, c_entropy = compiled(*args)
    c_loss.backward()
    torch.testing.assert_close(c_loss, loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c_entropy, entropy, atol=1e-5, rtol=1e-5)
    for p, expected in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, expected, atol=1e-5, rtol=1e-4)


def test_torch_compile_full_graph_of_the_operators():
    # The operators themselves capture into one graph (no breaks), forward and backward.
    problem = make_problem(B=2, L=5, V=200, D=32, seed=5)
    args = loss_op_args(problem, LossConfig())

    def step(*op_args):
        loss = torch.ops.sage_kernels.triton_sage_loss(*op_args)[0]
        logp, _ = torch.ops.sage_kernels.triton_logprobs_entropy(
            op_args[0].detach(), op_args[1].detach(), None, op_args[3].reshape(-1), 1.0, 1.0, False
        )
        return loss, logp

    loss, logp = torch.compile(step, backend=COMPILE_BACKEND, fullgraph=True)(*args)
    loss.backward()
    expected_loss, expected_logp = step(*loss_op_args(problem, LossConfig()))
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(logp, expected_logp)
    assert args[0].grad is not None and torch.isfinite(args[0].grad).all()


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    problem = make_problem(B=1, L=3, V=50, D=16)
    problem = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in problem.items()}
    with pytest.raises(ValueError, match="CUDA tensors"):
        fused_linear_sage_loss(backend="triton", **problem)


def test_boundary_records_round_trip_their_flat_form():
    problem = make_problem(B=2, L=5, V=200, D=32, seed=6)
    tensors = boundary.LossTensors.from_flat(loss_op_args(problem, LossConfig())[: len(boundary.LossTensors._fields)])
    assert tensors.flat()[4] is tensors.mask and boundary.LossTensors.from_flat(tensors.flat()) == tensors
    flags = boundary.BackwardFlags.of(
        LossConfig(logit_scale=1.5, logit_softcap=3.0, temperature=0.5),
        need_hidden=True,
        need_weight=False,
        need_bias=True,
    )
    assert flags._asdict() == dict(
        logit_inner=0.5,
        logit_outer=6.0,
        softcap=True,
        entropy_grad=False,
        need_hidden=True,
        need_weight=False,
        need_bias=True,
    )
    schema = torch.ops.sage_kernels.triton_sage_loss_backward.default._schema
    keyword_only = [a.name for a in schema.arguments if a.kwarg_only]
    assert keyword_only == list(boundary.BackwardFlags._fields)  # the flags travel by name
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    assert positional == ["grad_loss", *boundary.TwoPassSaved._fields]
    loss_schema = torch.ops.sage_kernels.triton_sage_loss.default._schema
    assert [a.name for a in loss_schema.arguments][: len(boundary.LossTensors._fields)] == list(
        boundary.LossTensors._fields
    )
    assert len(loss_schema.returns) == len(boundary.TwoPassOutputs._fields)
    local = torch.ops.sage_kernels.triton_sage_loss_local.default._schema
    assert len(local.returns) == len(boundary.LocalOutputs._fields)
    with pytest.raises(ValueError, match="LossTensors has 12 fields, got 9"):
        boundary.LossTensors.from_flat(tensors.flat()[:9])
