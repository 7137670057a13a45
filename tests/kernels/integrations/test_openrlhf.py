"""The OpenRLHF adapters against OpenRLHF 0.11.2's own ``PolicyLoss``, ``compute_approx_kl`` and
``Actor.forward`` (taken from its wheel: `peer_source`), guide off (equal) and on (equal to the
reference's SAGE KL)."""

import typing
from types import SimpleNamespace

import einops
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from peer_source import peer_functions
from tiny_lm import build_tokenizer, tiny_decoder_options

from sage_kernels import fused_linear_sage_loss
from sage_kernels.integrations import openrlhf as sage_openrlhf
from sage_kernels.integrations import verl as sage_verl
from sage_kernels.reference import kl_estimate, logits_of

F64 = torch.float64


def _unpad_input(hidden_states, attention_mask, unused_mask=None):
    """flash_attn.bert_padding.unpad_input, which OpenRLHF's packed path imports (flash-attn does not
    install on CPU): the kept rows of (batch x seqlen), their flat indices and the cu_seqlens."""
    lengths = attention_mask.sum(-1, dtype=torch.int32)
    indices = attention_mask.flatten().nonzero().flatten()
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return rows, indices, cu_seqlens, int(lengths.max()), lengths


def _pad_input(hidden_states, indices, batch, seqlen):
    """flash_attn.bert_padding.pad_input: the rows scattered back to (batch, seqlen, ...), zeros elsewhere."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    return out.index_put((indices,), hidden_states).reshape(batch, seqlen, *hidden_states.shape[1:])


def _not_called(*args, **kwargs):
    raise AssertionError("OpenRLHF's ring-attention helpers are not on the tested path")


@pytest.fixture(scope="module")
def openrlhf():
    scope = {"torch": torch, "nn": torch.nn, "F": F, "dist": dist, **{k: getattr(typing, k) for k in typing.__all__}}
    utils = ["masked_mean", "KL_IS_WEIGHT_CLIP", "compute_approx_kl", "compute_entropy", "_logsumexp_by_chunk"]
    peer_functions("openrlhf", "openrlhf/models/utils.py", utils + ["log_probs_from_logits"], scope)
    peer_functions("openrlhf", "openrlhf/models/loss.py", ["aggregate_loss", "PolicyLoss"], scope)
    scope.update(
        unpad_input=_unpad_input,
        pad_input=_pad_input,
        index_first_axis=lambda x, indices: x[indices],
        rearrange=einops.rearrange,
        all_gather=_not_called,
        get_tensor_in_current_ring_attn_rank=_not_called,
        update_ring_attn_params=_not_called,
    )
    ring = ["unpad_and_slice_tensor", "gather_and_pad_tensor"]
    peer_functions("openrlhf", "openrlhf/models/ring_attn_utils.py", ring, scope)
    peer_functions("openrlhf", "openrlhf/models/actor.py", ["Actor"], scope)
    return SimpleNamespace(**scope)


def batch(seed, B=4, L=7, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(B, L, generator=g, dtype=F64).clamp(0.02, 0.98))
    logp = (old + spread * torch.randn(B, L, generator=g, dtype=F64)).clamp(max=-1e-3)
    rollout = old + 0.4 * torch.randn(B, L, generator=g, dtype=F64)
    A = torch.randn(B, 1, generator=g, dtype=F64)
    mask = torch.rand(B, L, generator=g) > 0.2
    mask[:, 0] = True
    return old, logp, rollout, A.expand(B, L), mask.to(F64)


@pytest.mark.parametrize("unbiased, with_old", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_compute_approx_kl_equals_openrlhf(openrlhf, estimator, unbiased, with_old):
    old, logp, _, _, _ = batch(1)
    base = logp + 2.5 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    base[0, :2] = logp[0, :2] + torch.tensor([14.0, -14.0], dtype=F64)  # the clamps bind
    upstream = torch.randn(logp.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    results = []
    for fn in (sage_openrlhf.compute_approx_kl, openrlhf.compute_approx_kl):
        x = logp.clone().requires_grad_(True)
        value = fn(x, base, old if with_old else None, kl_estimator=estimator, unbiased_gradient=unbiased)
        (value * upstream).sum().backward()
        results.append((value.detach(), x.grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_to_the_anchor_is_the_sage_kl(openrlhf, estimator):
    """OpenRLHF's own estimator, given the anchor as base log-probs, is the reference's SAGE KL."""
    old, logp, ref, _, mask = batch(4)
    entropy = 3.0 * torch.rand(logp.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    anchor = sage_openrlhf.sage_anchor_log_probs(ref, entropy, mask, tau=0.8).double()
    log_q = torch.where(mask.bool(), sage_verl.sage_anchor_log_prob(ref, entropy, mask, tau=0.8).double() - ref, 0.0)
    assert (log_q > 0).any() and (log_q[~mask.bool()] == 0).all()
    want = kl_estimate(ref + log_q - logp, estimator)
    for fn in (openrlhf.compute_approx_kl, sage_openrlhf.compute_approx_kl):
        torch.testing.assert_close(fn(logp, anchor, kl_estimator=estimator).double(), want, rtol=1e-6, atol=1e-7)


def head(seed, B=3, L=6, D=16, V=30):
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(B, L, D, generator=g, dtype=F64), torch.randn(V, D, generator=g, dtype=F64) * 0.8
    ids, mask = torch.randint(0, V, (B, L), generator=g), torch.rand(B, L, generator=g) > 0.2
    mask[:, 0] = True
    return hidden, weight, ids, mask, torch.randn(B, generator=g, dtype=F64), g


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_use_kl_loss_with_the_anchor_equals_the_fused_sage_loss(openrlhf, estimator):
    """OpenRLHF's actor loss with --algo.kl.use_loss (its PolicyLoss + kl_coef * token mean of its
    compute_approx_kl against the anchor) on the first, on-policy update equals the fused SAGE loss
    (reference backend, branch guide, dapo's token mean): loss and d(hidden)."""
    hidden, weight, ids, mask, A, g = head(6)
    B, L = mask.shape
    ref = torch.log_softmax(logits_of(hidden.reshape(B * L, -1) + 0.3, weight, None, 1.0, F64), -1)
    ref = ref.gather(-1, ids.reshape(-1, 1)).view(B, L)
    beta, m = 0.3, mask.to(F64)

    def openrlhf_loss(h):
        logprobs = torch.log_softmax(logits_of(h.reshape(B * L, -1), weight, None, 1.0, F64), -1)
        logp = logprobs.gather(-1, ids.reshape(-1, 1)).view(B, L)
        entropy = -(logprobs.exp() * logprobs).sum(-1).view(B, L)
        anchor = sage_openrlhf.sage_anchor_log_probs(ref, entropy, m, tau=0.5).double()
        pg = openrlhf.PolicyLoss(0.2, 0.28)(logp, logp.detach(), A[:, None].expand(B, L), action_mask=m)[0]
        kl = openrlhf.compute_approx_kl(logp, anchor, logp.detach(), kl_estimator=estimator)
        return pg + beta * openrlhf.aggregate_loss(kl, m)

    x = hidden.clone().requires_grad_(True)
    want = openrlhf_loss(x)
    want.backward()
    y = hidden.clone().requires_grad_(True)
    out = fused_linear_sage_loss(
        y, weight, ids, mask, A, ref_logp=ref, beta=beta, kl=estimator, guide="branch", tau=0.5,
        loss_type="dapo", eps_low=0.2, eps_high=0.28, backend="reference",
    )  # fmt: skip
    out.loss.backward()
    # OpenRLHF's estimator computes in float32 (its `.float()`), the reference in float64
    torch.testing.assert_close(out.loss, want, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-5, atol=1e-8)
    assert float(out.metrics["sage/q_max"]) > 1


CORRECTIONS = {
    "off": {},
    "icepop": dict(is_correction_level="token", is_correction_mode="mask", is_correction_threshold=(0.7, 1.4)),
    "tis": dict(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.0, 1.2)),
    "seq-mask-tis": dict(is_correction_level="seq", is_correction_mode="mask", is_correction_threshold=(0.8, 1.3)),
    "binary-kl-token": dict(
        is_correction_level="token", is_correction_gating="binary_kl", is_correction_threshold=(0, 0.05)
    ),
    "binary-kl-seq": dict(
        is_correction_level="seq", is_correction_gating="binary_kl", is_correction_threshold=(0, 0.04)
    ),
    "tv-token": dict(is_correction_level="token", is_correction_gating="tv", is_correction_threshold=(0, 0.1)),
    "tv-seq": dict(is_correction_level="seq", is_correction_gating="tv", is_correction_threshold=(-1, 0.1)),
}
AGGREGATION = {
    "token-mean": dict(token_level_loss=True, call={}),
    "token-global": dict(token_level_loss=True, call=dict(dp_size=2, batch_num_tokens=40.0)),
    "sample-mean": dict(token_level_loss=False, call={}),
    "sample-global": dict(token_level_loss=False, call=dict(dp_size=2, global_batch_size=7.0)),
}


def both_losses(openrlhf, options: dict, logp, old, A, mask, rollout, call: dict) -> list:
    """[(outputs, d loss / d logp)] of our `SAGEPolicyLoss` then OpenRLHF's `PolicyLoss`, both built with
    `options` and called on the same batch (`call`: the aggregation's call options)."""
    results = []
    for cls in (sage_openrlhf.SAGEPolicyLoss, openrlhf.PolicyLoss):
        x = logp.clone().requires_grad_(True)
        out = cls(**options)(x, old, A, action_mask=mask, rollout_log_probs=rollout, **call)
        out[0].backward()
        results.append((out, x.grad))
    return results


@pytest.mark.parametrize("aggregation", list(AGGREGATION))
@pytest.mark.parametrize("correction", list(CORRECTIONS))
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_equals_openrlhf(openrlhf, correction, aggregation, dual_clip):
    old, logp, rollout, A, mask = batch(7)
    agg = AGGREGATION[aggregation]
    options = dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip, token_level_loss=agg["token_level_loss"])
    options.update(CORRECTIONS[correction])
    (ours, ours_grad), (want, want_grad) = both_losses(openrlhf, options, logp, old, A, mask, rollout, agg["call"])
    torch.testing.assert_close(ours_grad.double(), want_grad, rtol=1e-6, atol=1e-8)
    for name, a, b in zip(("loss", "clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"), ours, want):
        if b is None:
            assert a is None, name
        else:
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-6, atol=1e-8, msg=name)
    assert 0 < float(want[1]) < 1
    if correction != "off":
        assert 0 < float(want[4]) < 1  # the correction binds somewhere


@pytest.mark.parametrize("aggregation", ["sample-mean", "sample-global", "token-mean"])
@pytest.mark.parametrize("correction", ["off", "icepop", "binary-kl-seq"])
def test_gspo_equals_openrlhf(openrlhf, correction, aggregation):
    """policy_loss_type="gspo": the row's mean log-ratio (against the rollout's under a correction, which
    then gates nothing), clipped, per-sequence mean whatever token_level_loss says."""
    old, logp, rollout, A, mask = batch(9, spread=0.5)
    A = A + 0.3 * torch.randn(A.shape, generator=torch.Generator().manual_seed(10), dtype=F64)  # per-token
    agg = AGGREGATION[aggregation]
    options = dict(
        clip_eps_low=0.1, clip_eps_high=0.12, policy_loss_type="gspo", token_level_loss=agg["token_level_loss"]
    )
    options.update(CORRECTIONS[correction])
    (ours, ours_grad), (want, want_grad) = both_losses(openrlhf, options, logp, old, A, mask, rollout, agg["call"])
    torch.testing.assert_close(ours_grad.double(), want_grad, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(ours[0].double(), want[0], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(ours[1].double(), want[1].double(), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(ours[2].double(), want[2].double(), rtol=1e-6, atol=1e-8)
    assert ours[3] is None and want[3] is None and ours[4] is None
    assert 0 < float(want[1]) < 1  # some rows clipped, not all


def test_policy_loss_adds_the_loss_types():
    """dppo_tv through OpenRLHF's signature: verl's numbers (the verl adapter equals verl's function)."""
    old, logp, _, A, mask = batch(8, spread=1.5)
    config = {"clip_ratio": 0.15, "clip_ratio_low": 0.15, "clip_ratio_high": 0.15, "global_batch_info": {}}
    want, metrics = sage_verl.compute_policy_loss_sage_dppo_tv(old, logp, A, mask, "token-mean", config)
    loss, clip_ratio, *_ = sage_openrlhf.SAGEPolicyLoss(0.15, 0.15, loss_type="dppo_tv")(logp, old, A, mask)
    torch.testing.assert_close(loss.double(), want.double(), rtol=1e-6, atol=1e-8)
    assert float(clip_ratio) == pytest.approx(metrics["actor/pg_clipfrac"]) and 0 < float(clip_ratio) < 1


def openrlhf_actor(openrlhf, model, temperature, packing_samples=False):
    """OpenRLHF's own Actor around `model`, as its __init__ leaves it for a text model (which also turns
    the model's KV cache off: transformers then reads packed sequences' boundaries from the positions)."""
    actor = openrlhf.Actor.__new__(openrlhf.Actor)
    torch.nn.Module.__init__(actor)
    actor.model, actor.temperature, actor.packing_samples = model, temperature, packing_samples
    model.config.use_cache = False
    return actor


@pytest.mark.parametrize("packing_samples", [False, True], ids=["padded", "packing_samples"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_patched_actor_forward_equals_openrlhf(openrlhf, temperature, packing_samples):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**tiny_decoder_options(tokenizer)))
    g = torch.Generator().manual_seed(1)
    sequences = torch.randint(3, len(tokenizer), (3, 9), generator=g)
    attention_mask = torch.ones(3, 9, dtype=torch.long)
    attention_mask[1, :2] = 0  # a left-padded prompt
    attention_mask[1, -1] = 0  # and a right-padded response
    attention_mask[2, :1] = 0
    attention_mask[2, -3:] = 0
    action_mask = attention_mask[:, -4:].clone()
    sequences[attention_mask == 0] = tokenizer.pad_token_id
    upstream = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)

    def run(actor):
        model.zero_grad()
        logp, output = actor(sequences, action_mask, attention_mask, return_output=True, return_entropy=True)
        entropy = output.entropy[:, -4:]
        ((logp * upstream[0]).sum() + (entropy * upstream[1] * action_mask).sum()).backward()
        return logp.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]

    want = run(openrlhf_actor(openrlhf, model, temperature, packing_samples))
    actor = openrlhf_actor(openrlhf, model, temperature, packing_samples)
    sage_openrlhf.patch_actor_forward(actor)
    got = run(actor)
    if packing_samples:  # the packed row's attention stops at each sequence: the padded layout's values
        padded = run(openrlhf_actor(openrlhf, model, temperature))
        torch.testing.assert_close(got[0], padded[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)  # the fused sweep accumulates in float32
    torch.testing.assert_close(got[1] * action_mask, want[1] * action_mask, rtol=1e-5, atol=1e-6)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_refusals_name_what_is_not_supported(openrlhf):
    refused = {
        "policy_loss_type": dict(policy_loss_type="grpo"),
        "is_correction_gating": dict(is_correction_level="token", is_correction_gating="chi2"),
        "is_correction_mode 'clip'": dict(
            is_correction_level="token", is_correction_mode="clip", is_correction_gating="tv"
        ),
        "is_correction_threshold's low bound": dict(is_correction_level="seq", is_correction_gating="binary_kl"),
        "policy_loss_type 'gspo' takes loss_type": dict(policy_loss_type="gspo", loss_type="dppo_tv"),
    }
    for message, options in refused.items():
        with pytest.raises(ValueError, match=message):
            sage_openrlhf.SAGEPolicyLoss(**options)
    for options in list(refused.values())[:4]:  # OpenRLHF refuses the same
        with pytest.raises((ValueError, AssertionError)):
            openrlhf.PolicyLoss(**options)(*batch(1)[:2], batch(1)[3], batch(1)[4])
    actor = SimpleNamespace(forward=None)
    sage_openrlhf.patch_actor_forward(actor)
    with pytest.raises(NotImplementedError, match="ring_attn_group"):
        actor.forward(torch.ones(1, 3), torch.ones(1, 2), torch.ones(1, 3), ring_attn_group=object())


B, L = 4, 7
SHAPES = {  # argument -> a wrong shape that OpenRLHF's PolicyLoss broadcasts or fails on without naming it
    "advantages": (L,),
    "old_log_probs": (1, L),
    "action_mask": (B, 1),
    "rollout_log_probs": (B, L + 1),
    "log_probs": (B * L,),
}


@pytest.mark.parametrize("argument", list(SHAPES))
def test_wrong_shapes_are_refused_by_name(argument):
    old, logp, rollout, A, mask = batch(11, B=B, L=L)
    given = dict(log_probs=logp, old_log_probs=old, advantages=A, action_mask=mask, rollout_log_probs=rollout)
    given[argument] = torch.ones(SHAPES[argument], dtype=F64)
    loss = sage_openrlhf.SAGEPolicyLoss(is_correction_level="token", is_correction_threshold=(0.5, 2.0))
    with pytest.raises(ValueError, match=rf"^{argument} must .*shape") as error:
        loss(**given)
    assert "\n" not in str(error.value)
    # [B, 1] advantages are one per row: the [B, L] expansion of them gives the same loss
    given[argument] = {"advantages": A, "old_log_probs": old, "action_mask": mask, "rollout_log_probs": rollout}.get(
        argument, logp
    )
    per_row = dict(given, advantages=A[:, :1])
    torch.testing.assert_close(loss(**per_row)[0], loss(**given)[0])


def test_advantages_of_one_per_column_are_not_read_as_rows():
    """The issue's case: advantages [B] with B == L broadcast along the columns in OpenRLHF's."""
    old, logp, _, _, mask = batch(12, B=5, L=5)
    with pytest.raises(ValueError, match=r"^advantages must have shape \[5, 5\] or \[5, 1\].*got \[5\]"):
        sage_openrlhf.SAGEPolicyLoss()(logp, old, torch.randn(5, dtype=F64), mask)


@pytest.mark.parametrize("aggregation", list(AGGREGATION))
@pytest.mark.parametrize("correction", ["off", "icepop", "tis", "seq-mask-tis", "tv-seq"])
def test_nothing_kept_gives_zero_loss_and_zero_gradients(openrlhf, correction, aggregation):
    old, logp, rollout, A, mask = batch(13)
    agg = AGGREGATION[aggregation]
    call = {k: v * 0 for k, v in agg["call"].items() if k != "dp_size"} | {"dp_size": agg["call"].get("dp_size", 1)}
    loss_fn = sage_openrlhf.SAGEPolicyLoss(token_level_loss=agg["token_level_loss"], **CORRECTIONS[correction])
    x = logp.clone().requires_grad_(True)
    out = loss_fn(x, old, A, action_mask=torch.zeros_like(mask), rollout_log_probs=rollout, **call)
    out[0].backward()
    assert float(out[0].detach()) == 0.0 and torch.equal(x.grad, torch.zeros_like(x))
    for metric in out[1:]:
        assert metric is None or float(metric) == 0.0
    peer = openrlhf.PolicyLoss(token_level_loss=agg["token_level_loss"], **CORRECTIONS[correction])
    assert torch.isnan(peer(logp, old, A, action_mask=torch.zeros_like(mask), rollout_log_probs=rollout)[0])


@pytest.mark.parametrize(
    "options",
    [dict(loss_type="dppo_tv"), dict(loss_type="cispo"), dict(loss_type="sapo"), dict(policy_loss_type="gspo")],
    ids=["dppo_tv", "cispo", "sapo", "gspo"],
)
def test_nothing_kept_gives_zero_loss_for_every_loss_type(options):
    old, logp, rollout, A, mask = batch(17)
    x = logp.clone().requires_grad_(True)
    out = sage_openrlhf.SAGEPolicyLoss(**options)(x, old, A, torch.zeros_like(mask), rollout_log_probs=rollout)
    out[0].backward()
    assert float(out[0].detach()) == 0.0 and torch.equal(x.grad, torch.zeros_like(x))
    assert float(out[1]) == 0.0 and float(out[2]) == 0.0


@pytest.mark.parametrize("level", ["token", "seq"])
def test_correction_without_rollout_log_probs_names_it(level):
    old, logp, _, A, mask = batch(14)
    with pytest.raises(ValueError, match="^rollout_log_probs .* is required with is_correction_level"):
        sage_openrlhf.SAGEPolicyLoss(is_correction_level=level)(logp, old, A, mask)


@pytest.mark.parametrize("argument", ["old_log_probs", "advantages"])
def test_non_finite_experience_tensors_are_named_where_kept(argument):
    old, logp, _, A, mask = batch(16)
    given = dict(old_log_probs=old.clone(), advantages=A.clone())
    loss_fn = sage_openrlhf.SAGEPolicyLoss()
    row, col = (mask == 0).nonzero()[0]
    given[argument][row, col] = float("nan")  # where no token is kept: ignored
    torch.testing.assert_close(loss_fn(logp, action_mask=mask, **given)[0], loss_fn(logp, old, A, mask)[0])
    given[argument][0, 0] = float("inf")
    with pytest.raises(ValueError, match=f"^{argument} has non-finite values"):
        loss_fn(logp, action_mask=mask, **given)


def test_non_finite_rollout_log_probs():
    """NaN where a token is kept: a ValueError naming rollout_log_probs; where none is kept: ignored,
    vllm_kl finite and the loss as if the value were any other."""
    old, logp, rollout, A, mask = batch(15)
    loss_fn = sage_openrlhf.SAGEPolicyLoss(is_correction_level="token", is_correction_threshold=(0.5, 2.0))
    kept = rollout.clone()
    kept[0, 0] = float("nan")
    with pytest.raises(ValueError, match="^rollout_log_probs has non-finite values"):
        loss_fn(logp, old, A, mask, rollout_log_probs=kept)
    dropped = rollout.clone()
    row, col = (mask == 0).nonzero()[0]
    dropped[row, col] = float("nan")
    got, want = (
        loss_fn(logp, old, A, mask, rollout_log_probs=dropped),
        loss_fn(logp, old, A, mask, rollout_log_probs=rollout),
    )
    assert torch.isfinite(got[3]) and torch.isfinite(got[0])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
