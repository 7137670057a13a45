"""Every bad input of docs/loss.md raises ValueError/TypeError naming the argument, before any computation."""

import dataclasses
import math
import re

import pytest
import torch

from sage_kernels import FusedLinearSAGELoss, LossConfig, fused_linear_sage_loss, logprobs_and_entropy
from sage_kernels.loss_types import LOSS_TYPES

B, L, D, V = 2, 3, 4, 5


def good():
    torch.manual_seed(0)
    return dict(
        hidden=torch.randn(B, L, D),
        weight=torch.randn(V, D),
        token_ids=torch.randint(0, V, (B, L)),
        mask=torch.ones(B, L, dtype=torch.bool),
        advantages=torch.randn(B),
        ref_logp=-torch.rand(B, L),
    )


def call(**changes):
    args = good()
    backend = changes.pop("backend", "reference")
    args.update(changes)
    return fused_linear_sage_loss(**{k: v for k, v in args.items() if v is not _DROP}, backend=backend)


_DROP = object()
META = torch.device("meta")


@pytest.mark.parametrize(
    "changes, error, words",
    [
        ({"hidden": torch.randn(B, L, D, 1)}, ValueError, "hidden must have 2 or 3 dimensions"),
        ({"hidden": torch.randn(B, L + 1, D)}, ValueError, "hidden must have shape [B=2, L=3, D]"),
        ({"hidden": torch.randn(B * L + 1, D)}, ValueError, "N = B*L = 6"),
        ({"hidden": torch.randint(0, 3, (B, L, D))}, TypeError, "hidden must be a floating-point"),
        ({"hidden": [[0.0]]}, TypeError, "hidden must be a torch.Tensor"),
        ({"weight": torch.randn(V, D + 1)}, ValueError, "weight must have shape [V, D=4]"),
        ({"weight": torch.randn(V, D, dtype=torch.float64)}, TypeError, "weight must have hidden's dtype"),
        ({"weight": torch.randn(V, D, device=META)}, ValueError, "weight must be on cpu"),
        ({"bias": torch.randn(V + 1)}, ValueError, "bias must have shape [V=5]"),
        ({"bias": torch.randn(V, dtype=torch.float16)}, TypeError, "bias must have hidden's dtype"),
        ({"bias": torch.tensor([0.0, -math.inf, 0.0, 0.0, 0.0])}, ValueError, "bias has non-finite"),
        ({"weight": torch.full((V, D), math.nan)}, ValueError, "weight has non-finite"),
        ({"hidden": torch.randn(B, L, D).to_sparse()}, TypeError, "hidden must be a dense (strided) tensor"),
        ({"weight": torch.randn(V, D).to_sparse_csr()}, TypeError, "weight must be a dense (strided) tensor"),
        ({"mask": torch.ones(B, L).to_sparse()}, TypeError, "mask must be a dense (strided) tensor"),
        ({"advantages": torch.randn(B).to_sparse()}, TypeError, "advantages must be a dense (strided) tensor"),
        ({"token_ids": torch.zeros(B, L)}, TypeError, "token_ids must be an integer tensor"),
        ({"token_ids": torch.zeros(B * L, dtype=torch.long)}, ValueError, "token_ids must have 2 dimensions"),
        ({"token_ids": torch.full((B, L), V)}, ValueError, "token_ids must be in [0, V=5)"),
        ({"token_ids": torch.full((B, L), -1)}, ValueError, "token_ids must be in [0, V=5)"),
        ({"mask": torch.ones(B, L + 1)}, ValueError, "mask must have shape [B=2, L=3]"),
        ({"advantages": torch.randn(B + 1)}, ValueError, "advantages must have shape [B=2]"),
        ({"advantages": torch.randn(B, L + 1)}, ValueError, "advantages must have shape"),
        ({"advantages": torch.ones(B, dtype=torch.long)}, TypeError, "advantages must be a floating-point"),
        ({"advantages": torch.tensor([1.0, math.nan])}, ValueError, "advantages has non-finite"),
        ({"hidden": torch.full((B, L, D), math.inf)}, ValueError, "hidden has non-finite"),
        ({"ref_logp": torch.full((B, L), math.nan)}, ValueError, "ref_logp has non-finite"),
        ({"ref_logp": torch.zeros(B, L + 1)}, ValueError, "ref_logp must have shape [B=2, L=3]"),
        ({"ref_logp": _DROP}, ValueError, "ref_logp is required when beta != 0"),
        ({"old_logp": torch.full((B, L), -math.inf)}, ValueError, "old_logp has non-finite"),
        ({"is_weights": torch.ones(B, L, device=META)}, ValueError, "is_weights must be on cpu"),
        ({"log_q": torch.ones(B)}, ValueError, "log_q must have shape"),
        ({"temperature": 0.0}, ValueError, "temperature must be > 0"),
        ({"temperature": -1.0}, ValueError, "temperature must be > 0"),
        ({"logit_scale": 0.0}, ValueError, "logit_scale must be > 0"),
        ({"logit_scale": math.inf}, ValueError, "logit_scale must be a finite number"),
        ({"logit_softcap": 0.0}, ValueError, "logit_softcap must be None or a finite number > 0"),
        ({"logit_softcap": -30.0}, ValueError, "logit_softcap must be None or a finite number > 0"),
        ({"logit_softcap": math.inf}, ValueError, "logit_softcap must be None or a finite number > 0"),
        ({"loss_type": "ppo"}, ValueError, "loss_type must be one of"),
        ({"kl": "k4"}, ValueError, "kl must be one of"),
        ({"guide": "entropy"}, ValueError, "guide must be one of"),
        ({"importance_sampling": "group"}, ValueError, "importance_sampling must be one of"),
        ({"q_min": 0.0}, ValueError, "q_min must be in (0, q_max=1.4]"),
        ({"q_min": 2.0}, ValueError, "q_min must be in (0, q_max=1.4]"),
        ({"eps_low": 1.0}, ValueError, "eps_low must be in [0, 1)"),
        ({"delta_clip": 0.9}, ValueError, "delta_clip must be None or a number > 1"),
        ({"kl_clamp": 0.0}, ValueError, "kl_clamp must be None or a finite number > 0"),
        ({"kl_clamp": float("inf")}, ValueError, "kl_clamp must be None or a finite number > 0"),
        ({"dual_clip_c": 1.0}, ValueError, "dual_clip_c must be None or a number > 1"),
        ({"top_entropy_quantile": 0.0}, ValueError, "top_entropy_quantile must be in (0, 1]"),
        ({"beta": math.nan}, ValueError, "beta must be a finite number"),
        ({"gamma": -0.1}, ValueError, "gamma must be >= 0"),
        ({"max_completion_length": 0}, ValueError, "max_completion_length must be None or a positive int"),
        ({"max_completion_length": True}, ValueError, "max_completion_length must be None or a positive int"),
        ({"beta": -0.1}, ValueError, "beta must be >= 0"),
        ({"num_items_in_batch": 0}, ValueError, "num_items_in_batch must be None or a finite number > 0"),
        ({"num_items_in_batch": math.inf}, ValueError, "num_items_in_batch must be None or a finite number > 0"),
        (
            {"num_items_in_batch": torch.tensor(0.0)},
            ValueError,
            "num_items_in_batch must be a finite number > 0, got 0.0",
        ),
        (
            {"num_items_in_batch": torch.tensor(-3)},
            ValueError,
            "num_items_in_batch must be a finite number > 0, got -3",
        ),
        (
            {"num_items_in_batch": torch.tensor([math.nan])},
            ValueError,
            "num_items_in_batch must be a finite number > 0",
        ),
        ({"num_items_in_batch": torch.tensor(True)}, ValueError, "num_items_in_batch must be a real tensor"),
        ({"temperature": 1e-40}, ValueError, "keep logit_scale / temperature within float32 (at most 3.403e+38)"),
        ({"logit_scale": 1e39}, ValueError, "keep logit_scale / temperature within float32"),
        ({"logit_softcap": 1e-30, "logit_scale": 1e10}, ValueError, "keep logit_scale / logit_softcap within float32"),
        ({"learning_rate": 1e-3}, TypeError, "unknown loss option(s) ['learning_rate']"),
        ({"backend": "cuda"}, ValueError, "backend must be 'auto' or one of"),
        ({"config": {"beta": 0.1}}, TypeError, "config must be a LossConfig"),
    ],
)
def test_bad_input_raises_naming_the_argument(changes, error, words):
    with pytest.raises(error) as info:
        call(**changes)
    assert words in str(info.value)


def test_float64_only_for_the_reference():
    args = {k: (v.double() if v.is_floating_point() else v) for k, v in good().items()}
    fused_linear_sage_loss(**args, backend="reference")
    with pytest.raises(TypeError, match="hidden must have dtype in"):
        fused_linear_sage_loss(**args, backend="cpu")


def test_out_of_range_ids_are_fine_under_the_mask():
    ids = torch.randint(0, V, (B, L))
    ids[1, 2] = 10_000
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 2] = False
    out = call(token_ids=ids, mask=mask)
    assert torch.isfinite(out.loss)


def test_nonfinite_log_probs_under_the_mask_are_ignored():
    ref = -torch.rand(B, L)
    ref[0, 1] = -math.inf
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, 1] = False
    assert torch.isfinite(call(ref_logp=ref, mask=mask).loss)


def test_config_and_options_combine():
    config = LossConfig(beta=0.1, loss_type="bnpo")
    assert config.replace(beta=0.2) == LossConfig(beta=0.2, loss_type="bnpo")
    a = call(config=config, beta=0.0)
    b = call(config=LossConfig(beta=0.0, loss_type="bnpo"))
    assert a.loss.item() == b.loss.item()


@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_a_loss_types_own_options_are_config_fields_refused_on_the_other_types(loss_type):
    kind = LOSS_TYPES[loss_type]
    assert set(kind.options) <= {field.name for field in dataclasses.fields(LossConfig)}
    for option, value in (("delta_clip", 2.0), ("dual_clip_c", 3.0), ("luspo_include_padding", True)):
        if option in kind.options:
            assert getattr(LossConfig(loss_type=loss_type, **{option: value}), option) == value
        else:
            with pytest.raises(ValueError, match=f"^{option} must be"):
                LossConfig(loss_type=loss_type, **{option: value})


def test_scoring_validation():
    args = good()
    with pytest.raises(ValueError, match="temperature must be a number > 0"):
        logprobs_and_entropy(args["hidden"], args["weight"], args["token_ids"], temperature=0)
    with pytest.raises(ValueError, match="hidden must have shape"):
        logprobs_and_entropy(args["hidden"], args["weight"], args["token_ids"][:, :2])
    with pytest.raises(ValueError, match="logit_scale must be > 0"):
        logprobs_and_entropy(args["hidden"], args["weight"], args["token_ids"], logit_scale=-1.0)
    with pytest.raises(ValueError, match="logit_softcap must be None or a finite number > 0"):
        logprobs_and_entropy(args["hidden"], args["weight"], args["token_ids"], logit_softcap=0.0)
    with pytest.raises(ValueError, match=r"token_ids must be in \[0, V=5\)"):
        logprobs_and_entropy(args["hidden"], args["weight"], args["token_ids"] + V, backend="reference")


@pytest.mark.parametrize("backend, native", [("reference", None), ("cpu", True), ("cpu", False), ("triton", None)])
def test_logits_beyond_float32_are_a_clear_error(backend, native, monkeypatch):
    """logit_scale = 1e38 is a float32 number, but s (W h + b) is not once |W h + b| > 3.4: the loss and
    the scoring raise naming temperature and logit_scale (before: NaN on every backend)."""
    monkeypatch.setenv("SAGE_CPU_NATIVE", "1" if native else "0")
    words = "temperature=1.0 and logit_scale=1e+38 (logit_softcap=None) make the logits s (W h + b) / T overflow"
    with pytest.raises(ValueError, match=re.escape(words)):
        call(logit_scale=1e38, backend=backend)
    args = good()
    with pytest.raises(ValueError, match=re.escape(words)):
        logprobs_and_entropy(args["hidden"], args["weight"], args["token_ids"], logit_scale=1e38, backend=backend)
    with pytest.raises(ValueError, match="keep logit_scale / temperature within float32"):
        logprobs_and_entropy(args["hidden"], args["weight"], args["token_ids"], temperature=1e-40, backend=backend)


def test_module_rejects_unknown_options():
    with pytest.raises(TypeError):
        FusedLinearSAGELoss(learning_rate=1.0)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("rows, cols", [(0, L), (B, 0)])
def test_a_batch_without_tokens_is_a_clear_error(backend, rows, cols):
    """B = 0 or L = 0 has no loss to return (an all-masked batch, which has, gives zero)."""
    with pytest.raises(ValueError, match=rf"B >= 1 rows and L >= 1 columns, got shape \({rows}, {cols}\)"):
        call(
            hidden=torch.randn(rows, cols, D),
            token_ids=torch.zeros(rows, cols, dtype=torch.long),
            mask=torch.ones(rows, cols, dtype=torch.bool),
            advantages=torch.randn(rows),
            ref_logp=torch.zeros(rows, cols),
            backend=backend,
        )
