"""`FusedLinearSAGELoss.from_liger` against the real liger-kernel `LigerFusedLinearGRPOLoss`.

Same constructor arguments, same inputs, guide off: the loss, the metrics tuple and the
gradients of hidden states, LM head and bias of both, in float32, must be within the float32
tolerances of `tolerances.py` of one float64 oracle (our reference backend in float64, which
is Liger's maths): each side is measured by its own distance to the oracle, so an option whose
float32 rounding is large (vespo's weight) cannot fail a comparison both sides pass.
"""

import pytest
import torch

liger_grpo = pytest.importorskip("liger_kernel.chunked_loss.grpo_loss")

from tolerances import TOLERANCES, assert_close, assert_grad_close  # noqa: E402

from sage_kernels import FusedLinearSAGELoss  # noqa: E402
from sage_kernels.integrations import liger as sage_module  # noqa: E402

B, T, D, V = 3, 7, 16, 37
BACKEND = "auto"  # integration tests: the default backend of the device ("cpu" here)

CASES = {
    # id: (Liger constructor arguments, which optional forward inputs to pass)
    "grpo-token-beta0": (dict(loss_type="grpo", beta=0.0, use_ref_model=False), set()),
    "bnpo-token-kl-ref_logps": (dict(loss_type="bnpo", beta=0.1), {"ref_logps"}),
    "dr_grpo-token-kl-ref_input": (dict(loss_type="dr_grpo", beta=0.1, max_completion_length=9), {"ref_input"}),
    "dapo-token-kl-ref_weight-bias": (dict(loss_type="dapo", beta=0.04), {"ref_input", "ref_weight", "bias"}),
    "dapo-num_items": (dict(loss_type="dapo", beta=0.0, use_ref_model=False), {"num_items"}),
    "grpo-sequence-kl": (dict(loss_type="grpo", beta=0.05, importance_sampling_level="sequence"), {"ref_logps"}),
    "bnpo-sequence-vllm_is": (
        dict(loss_type="bnpo", beta=0.0, use_ref_model=False, importance_sampling_level="sequence"),
        {"vllm_row"},
    ),
    "dapo-token-vllm_is-delta": (
        dict(loss_type="dapo", beta=0.02, delta=1.1, epsilon_high=0.28),
        {"ref_logps", "vllm_token"},
    ),
    "grpo-temperature": (dict(loss_type="grpo", beta=0.1, temperature=0.7), {"ref_logps", "bias"}),
    # the new loss types and the bias-corrected KL, with old log-probs far from the current ones
    "cispo-far": (dict(loss_type="cispo", beta=0.05, epsilon_high=1.3), {"ref_logps", "far"}),
    "cispo-far-vllm_is-num_items": (
        dict(loss_type="cispo", beta=0.0, use_ref_model=False, epsilon_high=2.0),
        {"far", "vllm_token", "num_items"},
    ),
    "sapo-far": (
        dict(loss_type="sapo", beta=0.05, sapo_temperature_pos=1.3, sapo_temperature_neg=2.0),
        {"ref_logps", "far", "bias"},
    ),
    "sapo-far-delta-ignored": (dict(loss_type="sapo", beta=0.0, use_ref_model=False, delta=1.5), {"far"}),
    "luspo-sequence-far": (
        dict(loss_type="luspo", beta=0.0, use_ref_model=False, importance_sampling_level="sequence"),
        {"far"},
    ),
    # Liger's luspo sums padded positions too once its per-token loss is [B, T] (from_liger follows)
    "luspo-sequence-kl-far": (
        dict(loss_type="luspo", beta=0.1, importance_sampling_level="sequence"),
        {"ref_logps", "far", "bias"},
    ),
    "luspo-sequence-kl-ref_input-delta": (
        dict(loss_type="luspo", beta=0.05, importance_sampling_level="sequence", delta=1.5),
        {"ref_input", "far"},
    ),
    "luspo-token-kl-vllm_is-far": (dict(loss_type="luspo", beta=0.05), {"ref_logps", "far", "vllm_token"}),
    "vespo-far": (dict(loss_type="vespo", beta=0.05, vespo_k_pos=1.5, vespo_lambda_neg=2.5), {"ref_logps", "far"}),
    "vespo-far-vllm_is": (dict(loss_type="vespo", beta=0.0, use_ref_model=False), {"far", "vllm_token"}),
    "grpo-bias_kl-far": (dict(loss_type="grpo", beta=0.1, use_bias_correction_kl=True), {"ref_logps", "far"}),
    "dapo-sequence-bias_kl-far": (
        dict(loss_type="dapo", beta=0.1, use_bias_correction_kl=True, importance_sampling_level="sequence"),
        {"ref_input", "far"},
    ),
    "cispo-bias_kl-far": (
        dict(loss_type="cispo", beta=0.1, epsilon_high=1.5, use_bias_correction_kl=True),
        {"ref_logps", "far"},
    ),
}


def make_inputs(which, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, 5:] = 0
    mask[2, 2:] = 0
    adv = torch.tensor([1.0, -0.7, 0.4])
    with torch.no_grad():
        logp = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, ids[..., None]).squeeze(-1)
    inputs = dict(
        _input=hidden,
        lin_weight=weight,
        selected_token_ids=ids,
        attention_mask=mask,
        advantages=adv,
        old_per_token_logps=logp + (1.0 if "far" in which else 0.3) * torch.randn(B, T, generator=g),
    )
    if "bias" in which:
        inputs["bias"] = 0.1 * torch.randn(V, generator=g)
    if "ref_logps" in which:
        inputs["ref_per_token_logps"] = logp + 0.5 * torch.randn(B, T, generator=g)
    if "ref_input" in which:
        inputs["ref_input"] = hidden + 0.2 * torch.randn(B, T, D, generator=g)
        if "ref_weight" in which:
            inputs["ref_weight"] = weight + 0.1 * torch.randn(V, D, generator=g)
            if "bias" in which:
                inputs["ref_bias"] = 0.1 * torch.randn(V, generator=g)
        else:
            inputs["ref_weight"] = weight  # Liger needs it spelled out; we default to the policy's head
    if "vllm_row" in which:
        inputs["vllm_is_ratio"] = torch.rand(B, 1, generator=g) + 0.5
    if "vllm_token" in which:  # 1 at masked positions, as TRL makes them
        inputs["vllm_is_ratio"] = torch.where(mask.bool(), torch.rand(B, T, generator=g) + 0.5, 1.0)
    if "num_items" in which:
        inputs["num_items_in_batch"] = torch.tensor(23.0)
    return inputs


def run(module, inputs):
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items() if k in ("_input", "lin_weight", "bias")}
    loss, metrics = module(**{**inputs, **leaves})
    upstream = 1.7  # a non-unit upstream gradient exercises the backward's scaling
    (loss * upstream).backward()
    return loss.detach(), [m.detach() for m in metrics], {k: v.grad for k, v in leaves.items()}


def float64(inputs: dict) -> dict:
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}


def assert_both_near_oracle(sides: dict, oracle, what: str):
    """Each side's (loss, metrics, grads) within the float32 tolerances of the float64 `oracle`'s."""
    loss64, metrics64, grads64 = oracle
    for side, (loss, metrics, grads) in sides.items():
        assert_close(loss, loss64, torch.float32, "loss", f"{what}: {side} loss")
        assert len(metrics) == len(metrics64)
        for i, (got, want) in enumerate(zip(metrics, metrics64)):
            assert_close(got, want, torch.float32, "token", f"{what}: {side} metric {i}")
        assert grads.keys() == grads64.keys()
        for name in grads64:
            assert_grad_close(grads[name], grads64[name], torch.float32, f"{what}: {side} grad {name}")


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_liger(case):
    kwargs, which = CASES[case]
    inputs = make_inputs(which)
    liger = liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, **kwargs)
    ours = FusedLinearSAGELoss.from_liger(compiled=False, backend=BACKEND, **kwargs)
    oracle = run(FusedLinearSAGELoss.from_liger(compiled=False, backend="reference", **kwargs), float64(inputs))
    assert_both_near_oracle({"liger": run(liger, inputs), "ours": run(ours, inputs)}, oracle, case)


def test_clip_metric_is_measured_before_the_delta_cap():
    """A ratio above both delta and 1 + eps_high counts as clipped in Liger even though delta caps it."""
    inputs = make_inputs(set())
    inputs["old_per_token_logps"] = torch.full((B, T), -20.0)  # every ratio is huge
    inputs["advantages"] = torch.ones(B)
    module = FusedLinearSAGELoss.from_liger(beta=0.0, use_ref_model=False, delta=1.1, backend=BACKEND)
    _, metrics, _ = run(module, inputs)
    assert metrics[0].item() == 1.0


def test_frozen_head_like_liger():
    """A frozen LM head (LoRA): no weight gradient, the same hidden-state gradient as Liger."""
    inputs = make_inputs({"ref_logps"})
    grads = []
    for module in (
        liger_grpo.LigerFusedLinearGRPOLoss(compiled=False),
        FusedLinearSAGELoss.from_liger(backend=BACKEND),
    ):
        hidden = inputs["_input"].clone().requires_grad_(True)
        weight = inputs["lin_weight"].clone()
        module(**{**inputs, "_input": hidden, "lin_weight": weight})[0].backward()
        assert weight.grad is None
        grads.append(hidden.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def test_sage_metrics_are_kept_by_name():
    inputs = make_inputs({"ref_logps"})
    _, metrics = FusedLinearSAGELoss.from_liger(guide="branch", tau=0.0, gamma=1.0, backend=BACKEND)(**inputs)
    assert {"sage/q_mean", "sage/q_min", "sage/q_max", "entropy", "kl"} <= metrics.named.keys()
    assert metrics.named["sage/q_max"].item() > 1.0  # the guide is on: q departs from 1


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "vespo"])
def test_sequence_level_refusal_is_at_forward_like_liger(loss_type):
    kwargs = dict(loss_type=loss_type, importance_sampling_level="sequence", beta=0.0, use_ref_model=False)
    inputs = make_inputs(set())
    modules = (
        liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, **kwargs),
        FusedLinearSAGELoss.from_liger(backend=BACKEND, **kwargs),
    )  # building succeeds for both
    for module in modules:
        with pytest.raises(ValueError, match="Sequence-level importance sampling is not supported"):
            module(**inputs)


def test_dr_grpo_without_length_raises_at_forward():
    module = FusedLinearSAGELoss.from_liger(loss_type="dr_grpo", beta=0.0, use_ref_model=False, backend=BACKEND)
    with pytest.raises(ValueError, match="max_completion_length"):
        module(**make_inputs(set()))


def test_both_reference_inputs_warn_like_liger():
    """In Liger's words: its own test matches "Using ref_per_token_logps"."""
    inputs = make_inputs({"ref_logps", "ref_input"})
    messages = []
    for module in (
        liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, beta=0.1),
        FusedLinearSAGELoss.from_liger(beta=0.1, backend=BACKEND),
    ):
        with pytest.warns(UserWarning, match="Using ref_per_token_logps") as caught:
            module(**inputs)
        messages.append([str(w.message) for w in caught if "ref_per_token_logps" in str(w.message)])
    assert (
        messages[1]
        == messages[0]
        == ["Both ref_per_token_logps and ref_input are provided. Using ref_per_token_logps."]
    )


def test_a_batch_without_tokens_logs_ligers_metrics():
    """Liger's means divide by max(tokens, 1): no completion token gives a KL of 0, not NaN."""
    inputs = make_inputs({"ref_logps"})
    inputs["attention_mask"] = torch.zeros(B, T)
    outputs = []
    for module in (
        liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, beta=0.1),
        FusedLinearSAGELoss.from_liger(beta=0.1, backend=BACKEND),
    ):
        loss, metrics = module(**inputs)
        outputs.append([loss.item()] + [m.item() for m in metrics])
    assert outputs[1] == outputs[0] == [0.0, 0.0, 0.0]


def test_bfloat16_luspo_at_sequence_level_is_nearer_the_float64_oracle_than_liger():
    """Liger's test_correctness fails the drop-in on 4 bf16 luspo cases that Liger passes: its torch
    reference forms the logits in bf16 (an error of ~0.1 at |z| ~ 30), and Liger rounds the same way.
    On such inputs (scattered padding, logits of spread ~16), the drop-in's gradients are the float64
    oracle's to bf16 precision, Liger's are not: the drop-in keeps float32 logits."""
    g = torch.Generator().manual_seed(1)
    b, t, d, v = 4, 32, 256, 1024
    hidden = torch.randn(b, t, d, generator=g).bfloat16()
    weight = torch.randn(v, d, generator=g).bfloat16()
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    with torch.no_grad():
        logp = torch.log_softmax(hidden.double() @ weight.double().t(), -1).gather(-1, ids[..., None]).squeeze(-1)
    inputs = dict(
        _input=hidden,
        lin_weight=weight,
        selected_token_ids=ids,
        attention_mask=mask,
        advantages=torch.tensor([-0.8, 1.1, 0.3, -0.2]).bfloat16(),
        ref_per_token_logps=(logp + 0.01 * torch.randn(b, t, generator=g)).float(),
        old_per_token_logps=(logp + 0.01 * torch.randn(b, t, generator=g)).float(),
    )
    kwargs = dict(loss_type="luspo", beta=0.1, importance_sampling_level="sequence")
    oracle = run(FusedLinearSAGELoss.from_liger(backend="reference", **kwargs), float64(inputs))[2]
    errors = {}
    for side, module in (
        ("liger", liger_grpo.LigerFusedLinearGRPOLoss(compiled=False, **kwargs)),
        ("ours", FusedLinearSAGELoss.from_liger(backend=BACKEND, **kwargs)),
    ):
        grads = run(module, inputs)[2]
        errors[side] = max(((grads[k].double() - oracle[k]).abs().max() / oracle[k].abs().max()).item() for k in oracle)
    assert errors["ours"] <= TOLERANCES[torch.bfloat16]["grad"], errors  # measured: 0.006
    assert errors["ours"] < errors["liger"] / 4, errors  # Liger's: 0.046


@pytest.mark.parametrize(
    "kwargs", [dict(sapo_temperature_pos=0.0), dict(sapo_temperature_neg=-1.0), dict(delta=-1.0)], ids=str
)
def test_constructor_refusals_like_liger(kwargs):
    with pytest.raises(ValueError):
        liger_grpo.LigerFusedLinearGRPOLoss(**kwargs)
    with pytest.raises(ValueError):
        FusedLinearSAGELoss.from_liger(loss_type="sapo" if "sapo" in next(iter(kwargs)) else "dapo", **kwargs)


def test_functional_has_ligers_signature_and_result():
    from liger_kernel.chunked_loss.functional import liger_fused_linear_grpo

    from sage_kernels import fused_linear_grpo

    inputs = make_inputs({"ref_logps", "far", "bias"})
    positional = [
        inputs[k]
        for k in (
            "_input",
            "lin_weight",
            "selected_token_ids",
            "attention_mask",
            "advantages",
            "bias",
            "ref_per_token_logps",
            "old_per_token_logps",
        )
    ]
    rest = [None, None, None, 0.1, 0.2, 1.4, "cispo", None, "token", 1.0, 1.05, 1.0, False, True, 1]
    losses = []
    for fn in (liger_fused_linear_grpo, fused_linear_grpo):
        hidden = positional[0].clone().requires_grad_(True)
        loss, metrics = fn(hidden, *positional[1:], *rest)
        loss.backward()
        losses.append((loss.detach(), [m.detach() for m in metrics], hidden.grad))
    torch.testing.assert_close(losses[1][0], losses[0][0], atol=1e-6, rtol=1e-5)
    for got, want in zip(losses[1][1], losses[0][1]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(losses[1][2], losses[0][2], atol=1e-6, rtol=1e-5)


def test_dapo_divisor_from_the_config_is_kept():
    inputs = make_inputs(set())
    module = FusedLinearSAGELoss(beta=0.0, guide="none", loss_type="dapo", num_items_in_batch=50.0, backend=BACKEND)
    reference = FusedLinearSAGELoss(beta=0.0, guide="none", loss_type="dapo", backend=BACKEND)
    tokens = inputs["attention_mask"].sum()
    torch.testing.assert_close(module(**inputs)[0] * 50.0, reference(**inputs)[0] * tokens)


def test_a_number_divisor_stays_a_number():
    # a device tensor made from a Python number (torch.as_tensor(n, device=cuda)) is a copy and a wait per call
    mask = make_inputs(set())["attention_mask"]
    n = sage_module._liger_dapo_normaliser(mask, 50.0)
    assert isinstance(n, float) and n == 50.0
    counted = sage_module._liger_dapo_normaliser(mask, torch.tensor(50.0))
    assert isinstance(counted, torch.Tensor) and float(counted) == 50.0


def test_gmpo_from_liger_matches_the_oracle_and_counts_log_space_clips():
    """Liger 0.8.5 has no gmpo: from_liger passes it to LossConfig (epsilons bound log r). The loss and
    gradients are the float64 reference's, and the clipped fraction counts log r > eps_high with A > 0
    and log r < -eps_low with A < 0 over the unmasked tokens."""
    kwargs = dict(loss_type="gmpo", beta=0.05, epsilon_low=0.4, epsilon_high=0.4)
    inputs = make_inputs({"ref_logps", "far", "vllm_token"})
    ours = run(FusedLinearSAGELoss.from_liger(compiled=False, backend=BACKEND, **kwargs), inputs)
    oracle = run(FusedLinearSAGELoss.from_liger(compiled=False, backend="reference", **kwargs), float64(inputs))
    assert_both_near_oracle({"ours": ours}, oracle, "gmpo")
    with torch.no_grad():
        logp = torch.log_softmax(inputs["_input"] @ inputs["lin_weight"].t(), -1)
        logp = logp.gather(-1, inputs["selected_token_ids"][..., None]).squeeze(-1)
    log_ratio = logp - inputs["old_per_token_logps"]
    A = inputs["advantages"][:, None]
    clipped = ((log_ratio > 0.4) & (A > 0)) | ((log_ratio < -0.4) & (A < 0))
    m = inputs["attention_mask"]
    want = (clipped.float() * m).sum() / m.sum()
    assert 0 < want < 1, "some tokens clipped, some not"
    assert ours[1][-1].item() == pytest.approx(want.item(), abs=1e-6)
