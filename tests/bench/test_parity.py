"""The whole-point float64 parity check (`benchmarks.parity`) at a tiny shape (CPU, interpreter): its
chunked float64 oracle against the reference's full autograd, then each path against the oracle."""

import json

import torch

from benchmarks import parity
from benchmarks.providers import SETTINGS
from benchmarks.shapes import Point, make_inputs
from sage_kernels import LossConfig, fused_linear_sage_loss

POINT = Point("tiny", 128, "fp32", 0.25, "cpu")


def test_the_chunked_float64_oracle_is_the_reference_backend():
    x = make_inputs(POINT)
    config = LossConfig(**{**SETTINGS, "guide": "none", "entropy_coef": 0.01, "temperature": 0.8})
    weight_rows, hidden_rows = parity.sampled_rows(x)
    assert weight_rows.numel() > parity.SPREAD_ROWS and hidden_rows.numel() == parity.HIDDEN_ROWS
    assert bool(x.mask.reshape(-1)[hidden_rows].all())  # only valid tokens are sampled
    parity.CHUNK, chunk = 48, parity.CHUNK  # several chunks, the last one short
    try:
        loss, grad_w, grad_h = parity.float64_reference(x, config, weight_rows, hidden_rows)
    finally:
        parity.CHUNK = chunk
    hidden = x.hidden.double().requires_grad_()
    weight = x.weight.double().requires_grad_()
    out = fused_linear_sage_loss(
        hidden,
        weight,
        x.token_ids,
        x.mask,
        x.advantages,
        old_logp=x.old_logp,
        ref_logp=x.ref_logp,
        backend="reference",
        config=config,
    )
    out.loss.backward()
    torch.testing.assert_close(loss, out.loss.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(grad_w, weight.grad[weight_rows], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(grad_h, hidden.grad.reshape(-1, POINT.d)[hidden_rows], atol=1e-12, rtol=1e-10)


def test_each_path_against_float64_on_the_whole_point(tmp_path):
    argv = ["--device", "cpu", "--shape", "tiny", "--n", "128", "--mask", "0.25", "--out", str(tmp_path)]
    assert parity.main(argv) == 0
    rows = {r["path"]: r for r in map(json.loads, (tmp_path / "parity.jsonl").read_text().splitlines())}
    assert set(rows) == {"three-matmul", "two-pass"}
    for name, row in rows.items():  # within the fp32 tolerances of tests/kernels/tolerances.py
        assert row["status"] == "ok" and row["path_taken"] == [name]
        assert row["err_loss_abs"] <= 1e-5 * (1 + abs(row["loss64"]))
        assert 0 < row["err_grad_weight_rel"] <= 1e-4 and 0 < row["err_grad_hidden_rel"] <= 1e-4
    text = (tmp_path / "parity.md").read_text()
    assert "| three-matmul | three-matmul |" in text and "| two-pass | two-pass |" in text


def test_the_verdict_holds_each_figure_to_the_tolerance_file():
    row = {"loss64": 2.0, "err_loss_abs": 1e-5, "err_grad_weight_rel": 2e-4, "err_grad_hidden_rel": 5e-5}
    judged = parity.verdict(row, torch.float32)  # loss: 1e-5 <= 1e-5 + 1e-5 * 2; grad: 1e-4
    assert judged == {"tolerance_loss": [1e-5, 1e-5], "tolerance_grad": 1e-4, "verdict": "fail: d(weight)"}
    assert parity.verdict({**row, "err_loss_abs": 4e-5}, torch.float32)["verdict"] == "fail: loss, d(weight)"
    assert parity.verdict(row, torch.bfloat16)["verdict"] == "pass"
