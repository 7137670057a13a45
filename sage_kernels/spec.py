"""The loss's options as code: `LossConfig`, checked when built, and the logit map it implies.

This is the one place where options are checked (``docs/loss.md``, "Bad input"); the inputs are
checked in `inputs.py`. String options map to small integer codes in `KL_CODES`, `GUIDE_CODES`,
`IS_LEVEL_CODES` and the loss-type table's (`loss_types.py`): kernels take those codes as
compile-time constants.
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


def is_number(value) -> bool:
    """A real number, not a bool."""
    return isinstance(value, Real) and not isinstance(value, bool)


def require(condition: bool, name: str, expected: str, value) -> None:
    """The one-line ValueError of a bad argument: its name, what it must be, what it got."""
    if not condition:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _check_count(n: torch.Tensor) -> None:
    """A tensor `num_items_in_batch` is finite and > 0: on CPU a ValueError now, on CUDA an
    asynchronous device assertion (no host sync, as `inputs.check_finite`)."""
    valid = (torch.isfinite(n) & (n > 0)).reshape(())
    if n.device.type == "cpu":
        require(bool(valid), "num_items_in_batch", "a finite number > 0", n.item())
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
                require(is_number(value) and math.isfinite(value), item.name, "a finite number", value)
            elif item.type == "bool":
                require(isinstance(value, bool), item.name, "True or False", value)
        require(self.kl in KL_CODES, "kl", f"one of {sorted(KL_CODES)}", self.kl)
        require(self.guide in GUIDE_CODES, "guide", f"one of {sorted(GUIDE_CODES)}", self.guide)
        require(self.loss_type in LOSS_TYPES, "loss_type", f"one of {sorted(LOSS_TYPES)}", self.loss_type)
        require(
            self.importance_sampling in IS_LEVEL_CODES,
            "importance_sampling",
            f"one of {sorted(IS_LEVEL_CODES)}",
            self.importance_sampling,
        )
        require(self.temperature > 0, "temperature", "> 0", self.temperature)
        require(self.logit_scale > 0, "logit_scale", "> 0", self.logit_scale)
        if self.logit_softcap is not None:
            require(
                is_number(self.logit_softcap) and math.isfinite(self.logit_softcap) and self.logit_softcap > 0,
                "logit_softcap",
                "None or a finite number > 0",
                self.logit_softcap,
            )
        _check_logit_slope(self.temperature, self.logit_scale, self.logit_softcap)
        require(self.beta >= 0, "beta", ">= 0 (0: no KL term)", self.beta)
        require(self.gamma >= 0, "gamma", ">= 0", self.gamma)
        require(0 < self.q_min <= self.q_max, "q_min", f"in (0, q_max={self.q_max}]", self.q_min)
        kind = LOSS_TYPES[self.loss_type]
        if kind.bounds == "log_ratio":  # a bound on the log-ratio, not 1 - eps_low on the ratio
            require(
                self.eps_low >= 0, "eps_low", f">= 0 for loss_type {self.loss_type!r} (a log-ratio bound)", self.eps_low
            )
        else:
            require(0 <= self.eps_low < 1, "eps_low", "in [0, 1)", self.eps_low)
        require(self.eps_high >= 0, "eps_high", ">= 0", self.eps_high)
        require(0 < self.top_entropy_quantile <= 1, "top_entropy_quantile", "in (0, 1]", self.top_entropy_quantile)
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            require(getattr(self, name) > 0, name, "> 0", getattr(self, name))
        if self.kl_clamp is not None:
            require(
                is_number(self.kl_clamp) and math.isfinite(self.kl_clamp) and self.kl_clamp > 0,
                "kl_clamp",
                "None or a finite number > 0",
                self.kl_clamp,
            )
        if self.off_policy_mask_threshold is not None:
            threshold = self.off_policy_mask_threshold
            require(
                is_number(threshold) and math.isfinite(threshold) and threshold >= 0,
                "off_policy_mask_threshold",
                "None or a finite number >= 0",
                threshold,
            )
        if kind.bounds == "ratio_cap":
            require(
                self.eps_high > 0,
                "eps_high",
                f"> 0 for loss_type {self.loss_type!r} (the cap on the ratio)",
                self.eps_high,
            )
        require(self.dppo_ratio_cap > 0, "dppo_ratio_cap", "> 0", self.dppo_ratio_cap)
        if kind.token_ratio:
            require(
                self.importance_sampling == "token",
                "importance_sampling",
                f"'token' for loss_type {self.loss_type!r} (its ratio is a token's, or the row's geometric mean)",
                self.importance_sampling,
            )
        if self.luspo_include_padding:
            require(
                "luspo_include_padding" in kind.options,
                "luspo_include_padding",
                f"False for loss_type {self.loss_type!r} (it selects luspo's aggregation)",
                self.luspo_include_padding,
            )
        for name in ("delta_clip", "dual_clip_c"):
            if name not in kind.options:
                require(
                    getattr(self, name) is None,
                    name,
                    f"None for loss_type {self.loss_type!r} (it applies to PPO clipping only)",
                    getattr(self, name),
                )
        if self.delta_clip is not None:
            require(
                is_number(self.delta_clip) and self.delta_clip > 1,
                "delta_clip",
                "None or a number > 1",
                self.delta_clip,
            )
        if self.dual_clip_c is not None:
            require(
                is_number(self.dual_clip_c) and self.dual_clip_c > 1,
                "dual_clip_c",
                "None or a number > 1",
                self.dual_clip_c,
            )
        if self.max_completion_length is not None:
            require(
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
                require(n.numel() == 1, "num_items_in_batch", "a number or a one-element tensor", tuple(n.shape))
                require(not (n.is_complex() or n.dtype == torch.bool), "num_items_in_batch", "a real tensor", n.dtype)
                _check_count(n)
            else:
                require(
                    is_number(n) and math.isfinite(n) and n > 0, "num_items_in_batch", "None or a finite number > 0", n
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
