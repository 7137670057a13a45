"""The adapters on packed sequences (``cu_seqlens``): `FusedLinearSAGELoss` and `fused_linear_grpo`
against their own padded call and against Liger's padded loss on the same sequences, and verl's
policy losses on packed tensors and on verl's remove-padding stream against the padded path."""

import pytest
import torch
from packed_batches import cu_of, pad, unpad
from tolerances import assert_close, assert_grad_close
from verl_cases import AGG_CASES as VERL_AGG_CASES
from verl_cases import Config

from sage_kernels import FusedLinearSAGELoss, fused_linear_grpo
from sage_kernels.integrations import verl as sage_verl

D, V = 16, 37
LENGTHS = [6, 0, 9, 4, 7]  # an empty sequence among them
BACKEND = "auto"  # integration tests: the default backend of the device ("cpu" here)


def packed_liger_inputs(which: set, seed=0) -> dict:
    """Liger's forward arguments for S packed sequences (prompt tokens unmasked, as in a packed stream)."""
    g = torch.Generator().manual_seed(seed)
    N, S = sum(LENGTHS), len(LENGTHS)
    hidden = torch.randn(N, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.5
    ids = torch.randint(0, V, (N,), generator=g)
    mask = torch.zeros(N)
    start = 0
    for n, prompt in zip(LENGTHS, (2, 0, 3, 1, 4)):
        mask[start + prompt : start + n] = 1.0
        start += n
    with torch.no_grad():
        logp = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, ids[:, None]).squeeze(-1)
    inputs = dict(
        _input=hidden,
        lin_weight=weight,
        selected_token_ids=ids,
        attention_mask=mask,
        advantages=torch.randn(S, generator=g),
        old_per_token_logps=logp + (1.0 if "far" in which else 0.3) * torch.randn(N, generator=g),
        cu_seqlens=cu_of(LENGTHS, torch.int32),
    )
    if "bias" in which:
        inputs["bias"] = 0.1 * torch.randn(V, generator=g)
    if "ref_logps" in which:
        inputs["ref_per_token_logps"] = logp + 0.5 * torch.randn(N, generator=g)
    if "ref_input" in which:
        inputs["ref_input"] = hidden + 0.2 * torch.randn(N, D, generator=g)
        inputs["ref_weight"] = weight
    if "vllm_row" in which:
        inputs["vllm_is_ratio"] = torch.rand(S, 1, generator=g) + 0.5
    if "vllm_token" in which:
        inputs["vllm_is_ratio"] = torch.where(mask.bool(), torch.rand(N, generator=g) + 0.5, 1.0)
    if "num_items" in which:
        inputs["num_items_in_batch"] = torch.tensor(23.0)
    return inputs


def padded_liger_inputs(packed: dict) -> dict:
    """The same sequences as Liger's padded [B, T] batch."""
    padded = {k: v for k, v in packed.items() if k != "cu_seqlens"}
    for name in (
        "_input",
        "selected_token_ids",
        "attention_mask",
        "old_per_token_logps",
        "ref_per_token_logps",
        "ref_input",
    ):
        if name in packed:
            padded[name] = pad(packed[name], LENGTHS)
    ratio = packed.get("vllm_is_ratio")
    if ratio is not None and ratio.dim() == 1:
        padded["vllm_is_ratio"] = pad(ratio, LENGTHS, fill=1.0)
    return padded


def run(fn, inputs):
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items() if k in ("_input", "lin_weight", "bias")}
    loss, metrics = fn(**{**inputs, **leaves})
    (loss * 1.7).backward()
    named = getattr(metrics, "named", None)  # SAGE's metrics by name (Liger has none)
    return loss.detach(), [m.detach() for m in metrics], named, {k: v.grad for k, v in leaves.items()}


def assert_packed_matches_padded(packed_result, padded_result):
    loss, metrics, named, grads = packed_result
    want_loss, want_metrics, want_named, want_grads = padded_result
    assert_close(loss, want_loss, torch.float32, "loss", "loss")
    assert len(metrics) == len(want_metrics)
    for got, want in zip(metrics, want_metrics):
        assert_close(got, want, torch.float32, "token", "metrics tuple")
    for name, want in want_named.items():
        if bool(torch.isnan(want)):
            assert bool(torch.isnan(named[name])), name
        else:
            assert_close(named[name], want, torch.float32, "token", name)
    for name, grad in grads.items():
        want = unpad(want_grads[name], LENGTHS) if name == "_input" else want_grads[name]
        assert_grad_close(grad, want, torch.float32, f"grad {name}")


MODULE_CASES = {
    # id: (from_liger arguments, which inputs)
    "grpo-sequence-kl": (dict(loss_type="grpo", beta=0.05, importance_sampling_level="sequence"), {"ref_logps"}),
    "bnpo-vllm_row": (dict(loss_type="bnpo", beta=0.0, use_ref_model=False), {"vllm_row"}),
    "dr_grpo-ref_input": (dict(loss_type="dr_grpo", beta=0.1, max_completion_length=9), {"ref_input"}),
    "dapo-vllm_token-delta-num_items": (
        dict(loss_type="dapo", beta=0.02, delta=1.1, epsilon_high=0.28),
        {"ref_logps", "vllm_token", "num_items"},
    ),
    "cispo-far": (dict(loss_type="cispo", beta=0.05, epsilon_high=1.3), {"ref_logps", "far"}),
    "sapo-far-bias": (dict(loss_type="sapo", beta=0.05, sapo_temperature_pos=1.3), {"ref_logps", "far", "bias"}),
    "luspo-sequence": (
        dict(loss_type="luspo", beta=0.05, importance_sampling_level="sequence", luspo_include_padding=False),
        {"ref_logps", "far"},
    ),
    "vespo-vllm_token": (dict(loss_type="vespo", beta=0.0, use_ref_model=False), {"far", "vllm_token"}),
    "gmpo-guide": (dict(loss_type="gmpo", beta=0.1, epsilon_low=0.4, epsilon_high=0.4, guide="branch"), {"ref_logps"}),
}


@pytest.mark.parametrize("case", list(MODULE_CASES), ids=list(MODULE_CASES))
def test_module_packed_matches_padded(case):
    arguments, which = MODULE_CASES[case]
    module = FusedLinearSAGELoss.from_liger(**arguments, backend=BACKEND)
    packed = packed_liger_inputs(which)
    assert_packed_matches_padded(run(module, packed), run(module, padded_liger_inputs(packed)))


@pytest.mark.parametrize("case", ["grpo-sequence-kl", "bnpo-vllm_row", "dapo-vllm_token-delta-num_items"])
def test_module_packed_matches_ligers_padded_loss(case):
    liger_grpo = pytest.importorskip("liger_kernel.chunked_loss.grpo_loss")
    arguments, which = MODULE_CASES[case]
    packed = packed_liger_inputs(which, seed=1)
    liger = liger_grpo.LigerFusedLinearGRPOLoss(**arguments, compiled=False)  # eager: the same maths, no compile wait
    ours = run(FusedLinearSAGELoss.from_liger(**arguments, backend=BACKEND), packed)
    theirs = run(liger, padded_liger_inputs(packed))
    assert_close(ours[0], theirs[0], torch.float32, "loss", "loss")
    for got, want in zip(ours[1], theirs[1]):
        assert_close(got, want, torch.float32, "token", "metrics tuple")
    for name, grad in ours[3].items():
        want = unpad(theirs[3][name], LENGTHS) if name == "_input" else theirs[3][name]
        assert_grad_close(grad, want, torch.float32, f"grad {name}")


def test_functional_takes_cu_seqlens():
    packed = packed_liger_inputs({"ref_logps"}, seed=2)
    cu_seqlens = packed.pop("cu_seqlens")
    args = [packed[k] for k in ("_input", "lin_weight", "selected_token_ids", "attention_mask", "advantages")]
    loss, metrics = fused_linear_grpo(
        *args, ref_per_token_logps=packed["ref_per_token_logps"], loss_type="grpo", beta=0.1, cu_seqlens=cu_seqlens
    )
    module = FusedLinearSAGELoss.from_liger(loss_type="grpo", beta=0.1, backend=BACKEND)
    want, want_metrics = module(*args, ref_per_token_logps=packed["ref_per_token_logps"], cu_seqlens=cu_seqlens)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(list(metrics), list(want_metrics))


def test_module_refusals_on_packed_sequences():
    packed = packed_liger_inputs({"vllm_row"})
    with pytest.raises(ValueError, match="^luspo_include_padding must be False with cu_seqlens"):
        FusedLinearSAGELoss.from_liger(loss_type="luspo", beta=0.0, use_ref_model=False)(**packed)
    module = FusedLinearSAGELoss.from_liger(loss_type="grpo", beta=0.0, use_ref_model=False)
    with pytest.raises(ValueError, match="^cu_seqlens must be non-decreasing"):  # before vllm_is_ratio is expanded
        module(**dict(packed, cu_seqlens=torch.tensor([0, 6, 3, 15, 19, 26])))


# ---------------------------------------------------------------- verl


#: verl's aggregation modes (verl_cases.py's), and seq-mean-token-sum-norm at its default length
AGG_CASES = {**VERL_AGG_CASES, "seq-mean-token-sum-norm-longest": ("seq-mean-token-sum-norm", {})}
POLICY_LOSSES = {
    "sage": sage_verl.compute_policy_loss_sage,
    "sage_sapo": sage_verl.compute_policy_loss_sage_sapo,
    "sage_dppo_tv": sage_verl.compute_policy_loss_sage_dppo_tv,
    "sage_dppo_kl": sage_verl.compute_policy_loss_sage_dppo_kl,
}


def verl_config(batch_info):
    return Config(
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        tau_pos=1.3,
        tau_neg=2.0,
        global_batch_info=batch_info,
    )


def policy_loss_and_grad(fn, old, logp, A, mask, mode, config, weights, **packed):
    lp = logp.clone().requires_grad_(True)
    loss, metrics = fn(old, lp, A, mask, mode, config, weights, **packed)
    loss.backward()
    return loss.detach(), metrics, lp.grad


@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
@pytest.mark.parametrize("case", list(AGG_CASES), ids=list(AGG_CASES))
@pytest.mark.parametrize("with_is", [False, True], ids=["no-is", "rollout-is"])
def test_verl_policy_loss_packed_matches_padded(loss, case, with_is):
    mode, batch_info = AGG_CASES[case]
    g = torch.Generator().manual_seed(3)
    N = sum(LENGTHS)
    mask = torch.rand(N, generator=g) > 0.3
    logp = -torch.rand(N, generator=g) * 3
    old = logp + 0.4 * torch.randn(N, generator=g)
    A = torch.randn(N, generator=g) * 2
    weights = torch.rand(N, generator=g) + 0.5 if with_is else None
    fn, config = POLICY_LOSSES[loss], verl_config(batch_info)
    cu_seqlens = cu_of(LENGTHS)
    packed = policy_loss_and_grad(
        fn,
        old[None],
        logp[None],
        A[None],
        mask[None],
        mode,
        config,
        None if weights is None else weights[None],
        cu_seqlens=cu_seqlens,
    )
    padded = policy_loss_and_grad(
        fn,
        *(pad(t, LENGTHS) for t in (old, logp, A, mask)),
        mode,
        config,
        None if weights is None else pad(weights, LENGTHS),
    )
    torch.testing.assert_close(packed[0], padded[0], atol=1e-6, rtol=1e-5)
    assert packed[1] == pytest.approx(padded[1], abs=1e-6)
    torch.testing.assert_close(packed[2][0], unpad(padded[2], LENGTHS), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case", list(AGG_CASES), ids=list(AGG_CASES))
def test_verl_policy_loss_on_verls_remove_padding_stream(case):
    """verl with use_remove_padding: the batch (left-padded prompts, right-padded responses) unpadded
    by its attention mask into one stream, the fused kernel on [1, nnz, D] hidden states and labels
    rolled by one; here the policy loss reads that stream with its cu_seqlens, against verl's padded
    path (log-probs sliced to the [B, R] response block). seq-mean-token-sum-norm's default length
    differs between the two layouts (R there, the longest sequence here): that case passes the factor."""
    mode, batch_info = AGG_CASES[case]
    if mode == "seq-mean-token-sum-norm" and "loss_scale_factor" not in batch_info:
        batch_info = dict(loss_scale_factor=5)
    g = torch.Generator().manual_seed(4)
    B, P, R = 3, 4, 5
    prompt_lengths, response_lengths = [4, 2, 3], [5, 3, 1]
    input_ids = torch.randint(0, V, (B, P + R), generator=g)
    attention_mask = torch.zeros(B, P + R, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.bool)
    for b in range(B):
        attention_mask[b, P - prompt_lengths[b] : P + response_lengths[b]] = 1
        response_mask[b, : response_lengths[b]] = True
    hidden = torch.randn(B, P + R, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.5
    old = -torch.rand(B, R, generator=g) * 3
    A = torch.randn(B, 1, generator=g).expand(B, R).contiguous()
    config = verl_config(batch_info)

    # verl's padded path: log-probs of every position, the response block sliced out
    h_pad, w_pad = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp_full, _ = sage_verl.linear_cross_entropy(h_pad, w_pad, torch.roll(input_ids, -1, dims=1), backend=BACKEND)
    padded_loss, padded_metrics = sage_verl.compute_policy_loss_sage(
        old, logp_full[:, P - 1 : P + R - 1], A, response_mask, mode, config
    )
    padded_loss.backward()

    # verl's remove-padding stream: unpad by the attention mask, roll the labels by one
    indices = attention_mask.reshape(-1).nonzero().squeeze(1)
    cu_seqlens = cu_of(attention_mask.sum(1).tolist(), torch.int32)
    ids_rmpad = input_ids.reshape(-1)[indices]
    h_rm = hidden.reshape(-1, D)[indices][None].clone().requires_grad_(True)
    w_rm = weight.clone().requires_grad_(True)
    logp_rmpad, _ = sage_verl.linear_cross_entropy(h_rm, w_rm, torch.roll(ids_rmpad, -1)[None], backend=BACKEND)
    # position j predicts token j + 1: the response-predicting positions, and verl's per-token
    # old log-probs and advantages placed there
    is_response = torch.zeros(B, P + R, dtype=torch.bool)
    is_response[:, P:] = response_mask
    mask_rmpad = torch.roll(is_response.reshape(-1)[indices], -1)
    where = mask_rmpad.nonzero().squeeze(1)
    old_rmpad = torch.zeros(len(indices)).index_copy(0, where, old[response_mask])
    A_rmpad = torch.zeros(len(indices)).index_copy(0, where, A[response_mask])
    packed_loss, packed_metrics = sage_verl.compute_policy_loss_sage(
        old_rmpad[None], logp_rmpad, A_rmpad[None], mask_rmpad[None], mode, config, cu_seqlens=cu_seqlens
    )
    packed_loss.backward()

    torch.testing.assert_close(packed_loss, padded_loss, atol=1e-6, rtol=1e-5)
    assert packed_metrics == pytest.approx(padded_metrics, abs=1e-6)
    torch.testing.assert_close(h_rm.grad[0], h_pad.grad.reshape(-1, D)[indices], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w_rm.grad, w_pad.grad, atol=1e-6, rtol=1e-5)


def test_verl_policy_loss_refuses_a_bad_layout():
    logp = torch.zeros(1, 8)
    config = verl_config({})
    with pytest.raises(ValueError, match=r"^cu_seqlens must start at 0 and end at N = 8"):
        sage_verl.compute_policy_loss_sage(logp, logp, logp, logp > -1, config=config, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"^advantages must have shape \[N=8\] or \[1, N=8\]"):
        sage_verl.compute_policy_loss_sage(
            logp, logp, torch.zeros(2, 4), logp > -1, config=config, cu_seqlens=torch.tensor([0, 5, 8])
        )
