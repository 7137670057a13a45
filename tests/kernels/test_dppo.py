"""DPPO (loss types dppo_tv, dppo_kl) and the straight-through KL estimators (k1+, k3+) against verl's
own functions (0.9.1's ``compute_policy_loss_dppo_tv/kl``, ``agg_loss`` and ``kl_penalty``, taken from
its wheel: `peer_source`), on every backend and through the verl registry adapter; and the backends
against the reference with the SAGE KL, the guide and the other options composed with them."""

from types import SimpleNamespace
from typing import Any, Optional

import parity
import pytest
import torch
from far_cases import far_problem
from peer_source import peer_functions

from sage_kernels import LossConfig, fused_linear_sage_loss
from sage_kernels.integrations import verl as sage_verl
from sage_kernels.reference import logits_of

F64 = torch.float64
CORE = "verl/trainer/ppo/core_algos.py"


class Config(dict):
    """verl's ActorConfig as its policy losses read it: attributes plus `.get`."""

    __getattr__ = dict.__getitem__


@pytest.fixture(scope="module")
def verl():
    """verl 0.9.1's DPPO losses, agg_loss and kl_penalty with its masked_mean / masked_sum."""
    masked = peer_functions("verl", "verl/utils/torch_functional.py", ["masked_sum", "masked_mean"], {"torch": torch})
    namespace = {
        "torch": torch,
        "Optional": Optional,
        "Any": Any,
        "verl_F": SimpleNamespace(**{k: masked[k] for k in ("masked_sum", "masked_mean")}),
        "ActorConfig": Config,
        "AlgoConfig": type("AlgoConfig", (), {}),  # verl asserts the config is not one
    }
    names = ["agg_loss", "compute_policy_loss_dppo_tv", "compute_policy_loss_dppo_kl", "kl_penalty"]
    return SimpleNamespace(**peer_functions("verl", CORE, names + ["kl_penalty_forward"], namespace))


def verl_config(eps_low=0.2, eps_high=0.28, cap=None):
    config = Config(clip_ratio=0.2, clip_ratio_low=eps_low, clip_ratio_high=eps_high, global_batch_info={})
    if cap is not None:
        config["clip_ratio_c"] = cap
    return config


def log_prob_batch(seed, B=4, L=7, spread=1.5):
    """Probabilities spread over (0, 1) so both sides of each trust region are crossed; old ones far."""
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(B, L, generator=g, dtype=F64).clamp(0.02, 0.98))
    logp = (old + spread * torch.randn(B, L, generator=g, dtype=F64)).clamp(max=-1e-3)
    A = torch.randn(B, 1, generator=g, dtype=F64).expand(B, L).clone()
    A[0, :3] = 0.0  # A = 0 takes verl's negative side
    mask = torch.rand(B, L, generator=g) > 0.2
    mask[:, 0] = True
    return old, logp, A, mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("cap", [None, 1.5], ids=["verl-cap", "cap-1.5"])
@pytest.mark.parametrize("loss_type", ["dppo_tv", "dppo_kl"])
def test_registry_adapter_equals_verl(verl, loss_type, cap, mode):
    old, logp, A, mask = log_prob_batch(3)
    weights = torch.rand(old.shape, generator=torch.Generator().manual_seed(1), dtype=F64) + 0.5
    ours_fn = getattr(sage_verl, f"compute_policy_loss_sage_{loss_type}")
    peer_fn = getattr(verl, f"compute_policy_loss_{loss_type}")
    config = verl_config(0.15, 0.25, cap) if loss_type == "dppo_tv" else verl_config(0.05, 0.08, cap)
    results = []
    for fn in (ours_fn, peer_fn):
        x = logp.clone().requires_grad_(True)
        loss, metrics = fn(old, x, A, mask.float(), mode, config, rollout_is_weights=weights)
        loss.backward()
        results.append((loss.detach().double(), x.grad, metrics))
    (ours, ours_grad, ours_metrics), (want, want_grad, want_metrics) = results
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_grad.double(), want_grad, rtol=1e-5, atol=1e-7)
    for name in want_metrics:
        assert ours_metrics[name] == pytest.approx(want_metrics[name], rel=1e-6, abs=1e-7), name
    assert 0 < want_metrics["actor/pg_clipfrac"] < 1  # both sides of the region are exercised


def head_problem(seed, B=3, L=8, D=16, V=40):
    g = torch.Generator().manual_seed(seed)
    problem = dict(
        hidden=torch.randn(B, L, D, generator=g, dtype=F64) * 0.6,
        weight=torch.randn(V, D, generator=g, dtype=F64),
        token_ids=torch.randint(0, V, (B, L), generator=g),
        mask=torch.rand(B, L, generator=g) > 0.2,
        advantages=torch.randn(B, generator=g, dtype=F64),
    )
    problem["mask"][:, 0] = True
    # every other token the most likely one (p near 1), so probability moves cross the trust regions
    z = problem["hidden"] @ problem["weight"].t()
    problem["token_ids"][:, ::2] = z.argmax(-1)[:, ::2]
    return problem, g


def verl_on_the_head(fn, problem, extra):
    """verl's function of the head's logp (float64 logits), and d(loss)/d(hidden)."""
    hidden = problem["hidden"].clone().requires_grad_(True)
    z = logits_of(hidden.reshape(-1, hidden.shape[-1]), problem["weight"], None, 1.0, F64)
    logp = torch.log_softmax(z, -1).gather(-1, problem["token_ids"].reshape(-1, 1)).view(problem["mask"].shape)
    loss, metrics = fn(logp, *extra)
    loss.backward()
    return loss.detach(), hidden.grad, metrics


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("loss_type", ["dppo_tv", "dppo_kl"])
def test_fused_loss_equals_verl_on_every_backend(verl, loss_type, backend):
    problem, g = head_problem(7)
    B, L = problem["mask"].shape
    with torch.no_grad():
        z = logits_of(problem["hidden"].reshape(B * L, -1), problem["weight"], None, 1.0, F64)
        logp = torch.log_softmax(z, -1).gather(-1, problem["token_ids"].reshape(-1, 1)).view(B, L)
    old = logp + 1.2 * torch.randn(B, L, generator=g, dtype=F64)
    config = verl_config(0.1, 0.15, 3.0) if loss_type == "dppo_tv" else verl_config(0.05, 0.08, 3.0)
    A = problem["advantages"][:, None].expand(B, L)
    peer = getattr(verl, f"compute_policy_loss_{loss_type}")
    want, want_grad, want_metrics = verl_on_the_head(
        lambda x: peer(old, x, A, problem["mask"].float(), "token-mean", config), problem, ()
    )
    dtype = F64 if backend == "reference" else torch.float32
    hidden = problem["hidden"].to(dtype).requires_grad_(True)
    out = fused_linear_sage_loss(
        hidden,
        problem["weight"].to(dtype),
        problem["token_ids"],
        problem["mask"],
        problem["advantages"].to(dtype),
        old_logp=old.to(dtype),
        loss_type=loss_type,
        beta=0.0,
        guide="none",
        eps_low=config["clip_ratio_low"],
        eps_high=config["clip_ratio_high"],
        dppo_ratio_cap=3.0,
        backend=backend,
    )
    out.loss.backward()
    tol = dict(rtol=1e-10, atol=1e-12) if backend == "reference" else dict(rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(out.loss.double(), want, **tol)
    torch.testing.assert_close(hidden.grad.double(), want_grad, **tol)
    region = float(out.metrics["clip_ratio/region_mean"])
    assert region == pytest.approx(want_metrics["actor/pg_clipfrac"], rel=1e-6) and 0 < region < 1


DPPO_CASES = {
    "tv": dict(loss_type="dppo_tv", eps_low=0.1, eps_high=0.15),
    "kl-branch-k3": dict(loss_type="dppo_kl", eps_low=0.05, eps_high=0.08, guide="branch", tau=0.5, gamma=1.0),
    "tv-cap-entropy-k1+": dict(loss_type="dppo_tv", dppo_ratio_cap=1.5, entropy_coef=0.02, kl="k1+"),
    "kl-quantile-bias_kl-k3+": dict(
        loss_type="dppo_kl", top_entropy_quantile=0.5, use_bias_correction_kl=True, kl="k3+", kl_clamp=5.0
    ),
    "tv-off_policy": dict(loss_type="dppo_tv", off_policy_mask_threshold=0.05),
}


@pytest.mark.parametrize("present", ["far-old", "is-weights-log-q-token-adv", "on-policy"])
@pytest.mark.parametrize("name", list(DPPO_CASES), ids=list(DPPO_CASES))
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_backends_match_the_reference(backend, name, present):
    presence = {
        "far-old": {},
        "is-weights-log-q-token-adv": dict(is_weights=True, log_q=True, adv_per_token=True),
        "on-policy": dict(old=False),
    }[present]
    problem = far_problem(len(name), **presence)
    config = LossConfig(beta=0.2, **{"guide": "none", **DPPO_CASES[name]})
    parity.check_against_reference(problem, config, backend, torch.float32, seed=len(name))


@pytest.mark.parametrize("options", [dict(importance_sampling="sequence"), dict(delta_clip=2.0), dict(dual_clip_c=3)])
def test_dppo_options_that_do_not_apply_raise(options):
    with pytest.raises(ValueError, match=next(iter(options))):
        LossConfig(loss_type="dppo_tv", **options)
    with pytest.raises(ValueError, match="dppo_ratio_cap"):
        LossConfig(loss_type="dppo_kl", dppo_ratio_cap=0.0)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("kl", ["k1+", "k3+", "k1", "k3", "k2"])
def test_kl_term_equals_verl_kl_penalty(verl, kl, backend):
    """beta * token-mean of verl's kl_penalty(logprob, ref_logprob, kl) and its gradient: the fused
    loss with the PG term off (A = 0), guide off, dapo's token mean. verl's k3 clamps; inputs stay
    inside its bounds."""
    problem, g = head_problem(11)
    B, L = problem["mask"].shape
    with torch.no_grad():
        z = logits_of(problem["hidden"].reshape(B * L, -1), problem["weight"], None, 1.0, F64)
        logp = torch.log_softmax(z, -1).gather(-1, problem["token_ids"].reshape(-1, 1)).view(B, L)
    ref = logp + 0.8 * torch.randn(B, L, generator=g, dtype=F64)
    m = problem["mask"].to(F64)
    want, want_grad, _ = verl_on_the_head(
        lambda x: (0.3 * (verl.kl_penalty(x, ref, kl) * m).sum() / m.sum(), {}), problem, ()
    )
    dtype = F64 if backend == "reference" else torch.float32
    hidden = problem["hidden"].to(dtype).requires_grad_(True)
    out = fused_linear_sage_loss(
        hidden,
        problem["weight"].to(dtype),
        problem["token_ids"],
        problem["mask"],
        torch.zeros(B, dtype=dtype),
        ref_logp=ref.to(dtype),
        kl=kl,
        beta=0.3,
        guide="none",
        loss_type="dapo",
        backend=backend,
    )
    out.loss.backward()
    tol = dict(rtol=1e-10, atol=1e-12) if backend == "reference" else dict(rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(out.loss.double(), want, **tol)
    torch.testing.assert_close(hidden.grad.double(), want_grad, **tol)
