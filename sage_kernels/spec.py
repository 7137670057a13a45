"""The loss contract as code: `LossConfig`, the validated inputs, the output type.

This is the one place where options and inputs are checked (``docs/loss.md``,
"Bad input"). Every backend receives a `SageInputs` that has passed `validate_inputs`,
so backends never re-check shapes, dtypes or devices.

String options map to small integer codes in `KL_CODES`, `GUIDE_CODES`, `IS_LEVEL_CODES` and
the loss-type table's (`loss_types.py`): kernels take those codes as compile-time constants.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from numbers import Real
from typing import NamedTuple

import torch

from .loss_types import LOSS_TYPES

KL_CODES = {"k1": 1, "k2": 2, "k3": 3, "fk3": 4, "k1+": 5, "k3+": 6}
GUIDE_CODES = {"none": 0, "branch": 1}
IS_LEVEL_CODES = {"token": 0, "sequence": 1}

#: dtypes the fast backends accept for `hidden`, `weight` and `bias`; the reference also takes float64.
FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REFERENCE_DTYPES = FAST_DTYPES + (torch.float64,)


def _is_number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _require(condition: bool, name: str, expected: str, value) -> None:
    if not condition:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _check_count(n: torch.Tensor) -> None:
    """A tensor `num_items_in_batch` is finite and > 0: on CPU a ValueError now, on CUDA an
    asynchronous device assertion (no host sync, as `_check_finite`)."""
    valid = (torch.isfinite(n) & (n > 0)).reshape(())
    if n.device.type == "cpu":
        _require(bool(valid), "num_items_in_batch", "a finite number > 0", n.item())
    else:
        torch._assert_async(valid, "num_items_in_batch must be a finite number > 0")


#: the largest float32: the fast backends' logit multipliers (`LogitMap`) must stay below it
FLOAT32_MAX = torch.finfo(torch.float32).max


def _check_logit_slope(temperature: float, logit_scale: float, logit_softcap: float | None) -> None:
    """The logits' multipliers are float32 numbers: s / T (dz/da at a = 0) and, under a softcap, s / c
    and c / T. Beyond that every logit overflows (z = inf, then NaN), on every backend."""
    ratios = {"logit_scale / temperature": logit_scale / temperature}
    if logit_softcap is not None:
        ratios.update({"logit_scale / logit_softcap": logit_scale / logit_softcap})
        ratios.update({"logit_softcap / temperature": logit_softcap / temperature})
    over = [name for name, value in ratios.items() if value > FLOAT32_MAX]
    if over:
        raise ValueError(
            f"temperature and logit_scale must keep {' and '.join(over)} within float32 (at most "
            f"{FLOAT32_MAX:.4g}), got temperature={temperature!r}, logit_scale={logit_scale!r}, "
            f"logit_softcap={logit_softcap!r}"
        )


@dataclass(frozen=True)
class LossConfig:
    """Options of the SAGE loss; defaults are the official SAGE code's. docs/loss.md gives each formula.

    beta: weight of the KL term. kl: estimator of KL(pi || q*pi_ref) per sampled token,
    "k1", "k2" or "k3" (default, TRL's); or "fk3" for the forward direction KL(q*pi_ref || pi); or verl's
    straight-through "k1+" and "k3+" (k1's or k3's value, k2's gradient).
    guide: "branch" (q from the policy's entropy) or
    "none" (q = 1, plain GRPO); an explicit ``log_q`` passed to the loss overrides it.
    gamma, tau, q_min, q_max: branch guide q = clamp(1 + gamma*(H - tau)+, q_min, q_max).
    loss_type: "grpo", "bnpo", "dr_grpo", "dapo", "luspo" (PPO clipping, TRL's normalisers),
    "cispo" (clipped, detached ratio times logp), "sapo" (sigmoid-gated ratio) or "vespo"
    (detached gamma weight of the sequence ratio times logp), as in TRL 1.16; or "gmpo" (GMPO: the
    geometric mean over the row of the token ratios, each clipped in log space by the sign of A;
    its eps_low and eps_high bound log r to [-eps_low, eps_high], any eps_low >= 0; GMPO's recipes
    use 0.4 for both).
    eps_low, eps_high: PPO clip range [1 - eps_low, 1 + eps_high]; for cispo eps_high is the cap
    on the ratio itself (TRL's meaning). delta_clip: cap on the unclipped ratio (TRL's ``delta``),
    > 1. dual_clip_c: PPO dual clip (verl's ``clip_ratio_c``), > 1. Both only for clipped types.
    importance_sampling: "token" or "sequence" (GSPO) ratios. top_entropy_quantile: keep
    the PG term only on the top rho fraction of tokens by entropy (1.0 keeps all).
    entropy_coef: entropy bonus. temperature: logits are divided by it.
    logit_scale (s, > 0) and logit_softcap (c, None or > 0): how the model maps its LM head's output
    a = W h + b to logits, applied before the temperature: z = s a / T, or z = c tanh(s a / c) / T
    under a softcap (HF's Cohere ``logit_scale``, Gemma 2/3's ``final_logit_softcapping``, in
    TRL's order: scale, softcap, temperature).
    max_completion_length: dr_grpo's normaliser (defaults to the padded length L).
    num_items_in_batch: the dapo/cispo/vespo normaliser, the number of completion tokens the loss
    is divided by (defaults to this call's count; TRL passes the global count divided by the
    number of processes); a number or a 0-d tensor, so no host sync is needed.
    sapo_temperature_pos, sapo_temperature_neg: SAPO gate temperatures for A > 0 and A <= 0.
    vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO gamma shape and rate
    for A >= 0 and A < 0. use_bias_correction_kl: multiply the per-token KL by the ratio
    (TRL's option; off by default here). luspo_include_padding: luspo only; sum every padded
    position into the loss, each row weighted by its token count (Liger 0.8.5's and TRL <= 1.15's
    form), instead of TRL 1.16's sum over unmasked tokens. kl_clamp: clamp delta = log(q*pi_ref / pi) to
    [-kl_clamp, kl_clamp] before the KL estimator, its gradient zero outside (verl clamps at 20);
    None clamps nothing (TRL's behaviour: one token with delta > ~88 overflows k3 and fk3).
    off_policy_mask_threshold: DeepSeek-V3.2's off-policy sequence mask (TRL's option): the PG term
    of a sequence with A < 0 is dropped when the mean over its tokens of sampling_logp - logp (a
    KL estimate against the sampler; old_logp when no sampling_logp is given) exceeds it; None
    (default) masks nothing. Where A is per token, the condition A < 0 is read per token.
    dppo_ratio_cap: "dppo_tv" and "dppo_kl" (DPPO, arXiv 2602.04879, as verl defines them) replace the
    clip by a trust region on the sampled token's probability (binary total variation p - p_old within
    [-eps_low, eps_high], or the binary KL within eps_high / eps_low, on the side the advantage's sign
    makes greedy); the PG term is the detached ratio, truncated at dppo_ratio_cap (verl's 20), times
    A logp, token mean over the batch (the dapo normaliser).
    """

    beta: float = 0.05
    kl: str = "k3"
    guide: str = "branch"
    gamma: float = 0.3
    tau: float = 1.2
    q_min: float = 0.6
    q_max: float = 1.4
    loss_type: str = "grpo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    delta_clip: float | None = None
    dual_clip_c: float | None = None
    importance_sampling: str = "token"
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    temperature: float = 1.0
    logit_scale: float = 1.0
    logit_softcap: float | None = None
    max_completion_length: int | None = None
    num_items_in_batch: object | None = field(default=None, compare=False)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    use_bias_correction_kl: bool = False
    luspo_include_padding: bool = False
    kl_clamp: float | None = None
    off_policy_mask_threshold: float | None = None
    dppo_ratio_cap: float = 20.0

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if item.type == "float":
                _require(_is_number(value) and math.isfinite(value), item.name, "a finite number", value)
            elif item.type == "bool":
                _require(isinstance(value, bool), item.name, "True or False", value)
        _require(self.kl in KL_CODES, "kl", f"one of {sorted(KL_CODES)}", self.kl)
        _require(self.guide in GUIDE_CODES, "guide", f"one of {sorted(GUIDE_CODES)}", self.guide)
        _require(self.loss_type in LOSS_TYPES, "loss_type", f"one of {sorted(LOSS_TYPES)}", self.loss_type)
        _require(
            self.importance_sampling in IS_LEVEL_CODES,
            "importance_sampling",
            f"one of {sorted(IS_LEVEL_CODES)}",
            self.importance_sampling,
        )
        _require(self.temperature > 0, "temperature", "> 0", self.temperature)
        _require(self.logit_scale > 0, "logit_scale", "> 0", self.logit_scale)
        if self.logit_softcap is not None:
            _require(
                _is_number(self.logit_softcap) and math.isfinite(self.logit_softcap) and self.logit_softcap > 0,
                "logit_softcap",
                "None or a finite number > 0",
                self.logit_softcap,
            )
        _check_logit_slope(self.temperature, self.logit_scale, self.logit_softcap)
        _require(self.beta >= 0, "beta", ">= 0 (0: no KL term)", self.beta)
        _require(self.gamma >= 0, "gamma", ">= 0", self.gamma)
        _require(0 < self.q_min <= self.q_max, "q_min", f"in (0, q_max={self.q_max}]", self.q_min)
        kind = LOSS_TYPES[self.loss_type]
        if kind.bounds == "log_ratio":  # a bound on the log-ratio, not 1 - eps_low on the ratio
            _require(
                self.eps_low >= 0, "eps_low", f">= 0 for loss_type {self.loss_type!r} (a log-ratio bound)", self.eps_low
            )
        else:
            _require(0 <= self.eps_low < 1, "eps_low", "in [0, 1)", self.eps_low)
        _require(self.eps_high >= 0, "eps_high", ">= 0", self.eps_high)
        _require(0 < self.top_entropy_quantile <= 1, "top_entropy_quantile", "in (0, 1]", self.top_entropy_quantile)
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            _require(getattr(self, name) > 0, name, "> 0", getattr(self, name))
        if self.kl_clamp is not None:
            _require(
                _is_number(self.kl_clamp) and math.isfinite(self.kl_clamp) and self.kl_clamp > 0,
                "kl_clamp",
                "None or a finite number > 0",
                self.kl_clamp,
            )
        if self.off_policy_mask_threshold is not None:
            threshold = self.off_policy_mask_threshold
            _require(
                _is_number(threshold) and math.isfinite(threshold) and threshold >= 0,
                "off_policy_mask_threshold",
                "None or a finite number >= 0",
                threshold,
            )
        if kind.bounds == "ratio_cap":
            _require(
                self.eps_high > 0,
                "eps_high",
                f"> 0 for loss_type {self.loss_type!r} (the cap on the ratio)",
                self.eps_high,
            )
        _require(self.dppo_ratio_cap > 0, "dppo_ratio_cap", "> 0", self.dppo_ratio_cap)
        if kind.token_ratio:
            _require(
                self.importance_sampling == "token",
                "importance_sampling",
                f"'token' for loss_type {self.loss_type!r} (its ratio is a token's, or the row's geometric mean)",
                self.importance_sampling,
            )
        if self.luspo_include_padding:
            _require(
                "luspo_include_padding" in kind.options,
                "luspo_include_padding",
                f"False for loss_type {self.loss_type!r} (it selects luspo's aggregation)",
                self.luspo_include_padding,
            )
        for name in ("delta_clip", "dual_clip_c"):
            if name not in kind.options:
                _require(
                    getattr(self, name) is None,
                    name,
                    f"None for loss_type {self.loss_type!r} (it applies to PPO clipping only)",
                    getattr(self, name),
                )
        if self.delta_clip is not None:
            _require(
                _is_number(self.delta_clip) and self.delta_clip > 1,
                "delta_clip",
                "None or a number > 1",
                self.delta_clip,
            )
        if self.dual_clip_c is not None:
            _require(
                _is_number(self.dual_clip_c) and self.dual_clip_c > 1,
                "dual_clip_c",
                "None or a number > 1",
                self.dual_clip_c,
            )
        if self.max_completion_length is not None:
            _require(
                isinstance(self.max_completion_length, int)
                and not isinstance(self.max_completion_length, bool)
                and self.max_completion_length > 0,
                "max_completion_length",
                "None or a positive int",
                self.max_completion_length,
            )
        n = self.num_items_in_batch
        if n is not None:
            if isinstance(n, torch.Tensor):
                _require(n.numel() == 1, "num_items_in_batch", "a number or a one-element tensor", tuple(n.shape))
                _require(not (n.is_complex() or n.dtype == torch.bool), "num_items_in_batch", "a real tensor", n.dtype)
                _check_count(n)
            else:
                _require(
                    _is_number(n) and math.isfinite(n) and n > 0, "num_items_in_batch", "None or a finite number > 0", n
                )

    @property
    def logit_map(self) -> LogitMap:
        """The logits' map from the head output, in the form the fast paths take."""
        return logit_map(self.temperature, self.logit_scale, self.logit_softcap)

    def replace(self, **options) -> LossConfig:
        """A copy with `options` changed; unknown names raise TypeError naming them."""
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(f"unknown loss option(s) {unknown}; expected some of {list(OPTION_NAMES)}")
        return dataclasses.replace(self, **options)


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(LossConfig))


class LogitMap(NamedTuple):
    """Logits from the head output a = W h + b as two multipliers: z = inner * a without a softcap,
    z = outer * tanh(inner * a) with one (inner = s / c, outer = c / T). The gradient through it is
    dz/da = inner without a softcap, inner * outer * (1 - tanh^2(inner * a)) with one; backwards form
    1 - tanh^2 from tanh's argument, not from z: 1 - (z / outer)^2 cancels where a logit saturates."""

    inner: float
    outer: float
    softcap: bool

    @property
    def slope(self) -> float:
        """dz/da where tanh is 0 (s / T): the factor every d(logits) carries."""
        return self.inner * self.outer


def logit_map(temperature: float, logit_scale: float = 1.0, logit_softcap: float | None = None) -> LogitMap:
    """The `LogitMap` of z = s a / T, or c tanh(s a / c) / T with a softcap c (`LossConfig`'s fields)."""
    if logit_softcap is None:
        return LogitMap(logit_scale / temperature, 1.0, False)
    return LogitMap(logit_scale / logit_softcap, logit_softcap / temperature, True)


def resolve_config(config: LossConfig | None, options: dict) -> LossConfig:
    """`config` (or the defaults) with keyword `options` applied."""
    if config is not None and not isinstance(config, LossConfig):
        raise TypeError(f"config must be a LossConfig or None, got {type(config).__name__}")
    return (config or LossConfig()).replace(**options) if options else (config or LossConfig())


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


def _check_tensor(name: str, value, *, ndim=None, device=None, float_=False) -> None:
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


def _check_finite(name: str, value: torch.Tensor, where: torch.Tensor | None = None) -> None:
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
    _check_tensor("hidden", hidden, ndim=(2, 3), float_=True)
    device = hidden.device
    if hidden.dtype not in allowed_dtypes:
        raise TypeError(f"hidden must have dtype in {[str(d) for d in allowed_dtypes]}, got {hidden.dtype}")
    _check_tensor("weight", weight, ndim=(2,), device=device, float_=True)
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    D = hidden.shape[-1]
    if weight.shape[1] != D:
        raise ValueError(f"weight must have shape [V, D={D}] to match hidden, got {tuple(weight.shape)}")
    V = weight.shape[0]
    if V == 0 or D == 0:
        raise ValueError(f"weight must be non-empty, got shape {tuple(weight.shape)}")
    if bias is not None:
        _check_tensor("bias", bias, ndim=(1,), device=device, float_=True)
        if tuple(bias.shape) != (V,):
            raise ValueError(f"bias must have shape [V={V}], got {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}")
        _check_finite("bias", bias)  # -inf too: mask a token with a finite bias such as finfo.min

    _check_tensor("token_ids", token_ids, ndim=(2,), device=device)
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

    _check_tensor("mask", mask, device=device)
    if tuple(mask.shape) != (B, L):
        raise ValueError(f"mask must have shape [B={B}, L={L}], got {tuple(mask.shape)}")
    mask = mask.bool() if mask.dtype != torch.bool else mask

    _check_tensor("advantages", advantages, ndim=(1, 2), device=device, float_=True)
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
        _check_tensor(name, value, device=device, float_=True)
        if tuple(value.shape) != (B, L):
            raise ValueError(f"{name} must have shape [B={B}, L={L}], got {tuple(value.shape)}")
        if name != "sampling_logp":  # NaN there marks a token the sampler could not score (TRL's convention)
            _check_finite(name, value, loss_mask)
        per_token[name] = torch.where(loss_mask, value.detach().to(cd), neutral)

    adv = advantages.detach().to(cd)
    adv = adv[:, None].expand(B, L) if adv.dim() == 1 else adv
    _check_finite("advantages", adv, loss_mask)
    _check_finite("hidden", hidden)
    _check_finite("weight", weight)
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
    _require(_is_number(temperature) and temperature > 0, "temperature", "a number > 0", temperature)
    # named as LossConfig names them, and checked there
    config = LossConfig(beta=0.0, temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap)
    _check_tensor("hidden", hidden, float_=True)
    _check_tensor("token_ids", token_ids, ndim=(1, 2), device=hidden.device)
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
