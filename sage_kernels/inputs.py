"""The loss's inputs as code: the validated inputs (`SageInputs`), the output type, and their checks.

This is the one place where inputs are checked (``docs/loss.md``, "Bad input"); the options are
checked in `spec.py`. Every backend receives a `SageInputs` that has passed `validate_inputs`, so
backends never re-check shapes, dtypes or devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec import LossConfig, is_number, require

#: dtypes the fast backends accept for `hidden`, `weight` and `bias`; the reference also takes float64.
FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REFERENCE_DTYPES = FAST_DTYPES + (torch.float64,)


@dataclass
class SageInputs:
    """Validated inputs in canonical form: hidden [N, D]; per-token tensors [B, L].

    `mask` is the completion mask; `loss_mask` marks the positions that enter the loss: the
    completion mask, or every position under `LossConfig.luspo_include_padding` (None means
    `mask`). Per-token float inputs are cast to the compute dtype (float32, or float64 when
    `hidden` is float64) and replaced outside `loss_mask` by neutral values (0 for log-probs,
    1 for `is_weights`), so garbage there cannot reach the loss. `sampling_logp` (the sampler's
    log-probs, read by the off-policy mask only) may hold NaN where the sampler could not score a
    token: such a token adds nothing to its sequence's KL estimate, as in TRL. Packed sequences
    (`packing.py`): the per-token tensors are on the [S, L] grid of the sequences, `hidden` holds
    the N token rows and `cells` [N] the grid cell of each (None: row n is cell n).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    token_ids: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    is_weights: torch.Tensor | None
    log_q: torch.Tensor | None
    loss_mask: torch.Tensor | None = None
    sampling_logp: torch.Tensor | None = None
    cells: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.mask

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.token_ids.shape)

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float64 if self.hidden.dtype == torch.float64 else torch.float32


@dataclass
class SageLossOutput:
    """The loss and its per-token parts.

    loss: scalar, differentiable. logp, entropy, q, kl, ratio: [B, L], detached; at positions
    outside the loss (masked ones, unless luspo_include_padding) logp = entropy = kl = 0 and
    q = ratio = 1. metrics: detached 0-d tensors named as in `metrics.METRIC_NAMES` (means over unmasked
    positions); no host sync is made for them.
    """

    loss: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor
    q: torch.Tensor
    kl: torch.Tensor
    ratio: torch.Tensor
    metrics: dict


def check_tensor(name: str, value, *, ndim=None, device=None, float_=False) -> None:
    """A dense tensor, of `ndim` dimensions (a tuple of allowed counts), on `device`, floating if
    `float_`: else the error that names it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {value.layout}; pass {name}.to_dense()")
    if ndim is not None and value.dim() not in ndim:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndim))} dimensions, got shape {tuple(value.shape)}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} must be on {device} like hidden, got {value.device}")
    if float_ and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")


def check_finite(name: str, value: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Report non-finite values. On CPU: ValueError now. On CUDA: an asynchronous device
    assertion, so no host-device sync is added to the hot path (it fails at the next sync)."""
    if where is None:
        # one reduction, not a bool tensor the size of `value` ([N, D] for hidden): max |x| is
        # finite exactly when every entry is (a NaN propagates through the max)
        finite = torch.isfinite(torch.linalg.vector_norm(value, float("inf")))
    else:
        finite = torch.isfinite(value) | ~where
    message = f"{name} has non-finite values (NaN or inf)"
    if value.device.type == "cpu":
        if not bool(finite.all()):
            raise ValueError(message)
    else:
        torch._assert_async(finite.all(), message)


def validate_inputs(
    hidden,
    weight,
    token_ids,
    mask,
    advantages,
    *,
    bias=None,
    old_logp=None,
    ref_logp=None,
    is_weights=None,
    log_q=None,
    sampling_logp=None,
    config: LossConfig,
    allowed_dtypes=FAST_DTYPES,
    cells=None,
) -> SageInputs:
    """Check everything docs/loss.md lists under "Bad input" and return canonical `SageInputs`.

    Raises ValueError / TypeError naming the argument and what was expected, before any
    computation (an empty batch, B = 0 or L = 0, is an error: there is no loss to return; a
    batch whose mask is all false gives a zero loss); values are scanned too (token-id range,
    non-finite numbers). `cells`: packed calls only (`packing.validate_packed_inputs`), the grid
    cell of each of hidden's [N, D] rows.
    """
    check_tensor("hidden", hidden, ndim=(2, 3), float_=True)
    device = hidden.device
    if hidden.dtype not in allowed_dtypes:
        raise TypeError(f"hidden must have dtype in {[str(d) for d in allowed_dtypes]}, got {hidden.dtype}")
    check_tensor("weight", weight, ndim=(2,), device=device, float_=True)
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    D = hidden.shape[-1]
    if weight.shape[1] != D:
        raise ValueError(f"weight must have shape [V, D={D}] to match hidden, got {tuple(weight.shape)}")
    V = weight.shape[0]
    if V == 0 or D == 0:
        raise ValueError(f"weight must be non-empty, got shape {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, ndim=(1,), device=device, float_=True)
        if tuple(bias.shape) != (V,):
            raise ValueError(f"bias must have shape [V={V}], got {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}")
        check_finite("bias", bias)  # -inf too: mask a token with a finite bias such as finfo.min

    check_tensor("token_ids", token_ids, ndim=(2,), device=device)
    if token_ids.is_floating_point() or token_ids.dtype == torch.bool or token_ids.is_complex():
        raise TypeError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    B, L = token_ids.shape
    if B == 0 or L == 0:  # no token: no loss to define (a batch with every token masked is fine)
        raise ValueError(
            f"token_ids must have B >= 1 rows and L >= 1 columns, got shape {(B, L)}; "
            f"skip the loss for a batch without tokens"
        )
    if hidden.dim() == 3 and tuple(hidden.shape[:2]) != (B, L):
        raise ValueError(f"hidden must have shape [B={B}, L={L}, D] to match token_ids, got {tuple(hidden.shape)}")
    if hidden.dim() == 2 and cells is None and hidden.shape[0] != B * L:
        raise ValueError(f"hidden given as [N, D] must have N = B*L = {B * L} rows, got {hidden.shape[0]}")

    check_tensor("mask", mask, device=device)
    if tuple(mask.shape) != (B, L):
        raise ValueError(f"mask must have shape [B={B}, L={L}], got {tuple(mask.shape)}")
    mask = mask.bool() if mask.dtype != torch.bool else mask

    check_tensor("advantages", advantages, ndim=(1, 2), device=device, float_=True)
    if advantages.dim() == 1 and advantages.shape[0] != B:
        raise ValueError(f"advantages must have shape [B={B}] or [B, L], got {tuple(advantages.shape)}")
    if advantages.dim() == 2 and tuple(advantages.shape) != (B, L):
        raise ValueError(f"advantages must have shape [B={B}] or [B={B}, L={L}], got {tuple(advantages.shape)}")

    if config.beta != 0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when beta != 0 (beta={config.beta}); pass beta=0 to drop the KL term")

    # the positions whose values are read: luspo_include_padding sums the padded ones into the loss too
    loss_mask = torch.ones_like(mask) if config.luspo_include_padding else mask
    where = "at every position (luspo_include_padding)" if config.luspo_include_padding else "at unmasked positions"
    cd = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    per_token = {}
    for name, value, neutral in (
        ("old_logp", old_logp, 0.0),
        ("ref_logp", ref_logp, 0.0),
        ("is_weights", is_weights, 1.0),
        ("log_q", log_q, 0.0),
        ("sampling_logp", sampling_logp, 0.0),
    ):
        if value is None:
            per_token[name] = None
            continue
        check_tensor(name, value, device=device, float_=True)
        if tuple(value.shape) != (B, L):
            raise ValueError(f"{name} must have shape [B={B}, L={L}], got {tuple(value.shape)}")
        if name != "sampling_logp":  # NaN there marks a token the sampler could not score (TRL's convention)
            check_finite(name, value, loss_mask)
        per_token[name] = torch.where(loss_mask, value.detach().to(cd), neutral)

    adv = advantages.detach().to(cd)
    adv = adv[:, None].expand(B, L) if adv.dim() == 1 else adv
    check_finite("advantages", adv, loss_mask)
    check_finite("hidden", hidden)
    check_finite("weight", weight)
    bad = ((token_ids < 0) | (token_ids >= V)) & loss_mask
    if device.type == "cpu":
        if bool(bad.any()):
            raise ValueError(f"token_ids must be in [0, V={V}) {where}; found {int(token_ids[bad][0])}")
    else:
        torch._assert_async(~bad.any(), f"token_ids must be in [0, V={V}) {where}")

    return SageInputs(
        hidden=hidden.reshape(-1, D),
        weight=weight,
        bias=bias,
        token_ids=torch.where(loss_mask, token_ids.long(), 0),
        mask=mask,
        advantages=torch.where(loss_mask, adv, 0.0),
        **per_token,
        loss_mask=loss_mask,
        cells=cells,
    )


def validate_scoring_inputs(
    hidden,
    weight,
    token_ids,
    *,
    bias=None,
    temperature=1.0,
    logit_scale=1.0,
    logit_softcap=None,
    allowed_dtypes=FAST_DTYPES,
):
    """Checks for `logprobs_and_entropy`; returns (hidden [N, D], token_ids [N], leading shape)."""
    require(is_number(temperature) and temperature > 0, "temperature", "a number > 0", temperature)
    # named as LossConfig names them, and checked there
    config = LossConfig(beta=0.0, temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap)
    check_tensor("hidden", hidden, float_=True)
    check_tensor("token_ids", token_ids, ndim=(1, 2), device=hidden.device)
    lead, n = tuple(token_ids.shape), token_ids.numel()
    if hidden.dim() < 2 or tuple(hidden.shape[:-1]) not in (lead, (n,)):
        raise ValueError(
            f"hidden must have shape [*{list(lead)}, D] or [{n}, D] to match token_ids, got {tuple(hidden.shape)}"
        )
    device = hidden.device
    inputs = validate_inputs(
        hidden.reshape(n, hidden.shape[-1]),
        weight,
        token_ids.reshape(1, n),
        torch.ones(1, n, dtype=torch.bool, device=device),
        torch.zeros(1, device=device),
        bias=bias,
        config=config,
        allowed_dtypes=allowed_dtypes,
    )
    return inputs.hidden, inputs.token_ids.reshape(n), lead
