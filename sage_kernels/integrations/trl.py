"""`SAGEGRPOTrainer`: TRL's `GRPOTrainer` with its loss computed by `fused_linear_sage_loss`.

Switching is two renames: ``GRPOConfig`` -> `SAGEGRPOConfig`, ``GRPOTrainer`` -> `SAGEGRPOTrainer`.
Generation, rewards, advantages and the reference/behaviour log-probs stay TRL's; only
`_compute_loss` changes. It takes the model's last hidden states and LM head (no [B, L, V]
logits) and computes the whole loss in one fused call: clipped PG term, KL to the SAGE anchor
q * pi_ref, top-entropy mask and the vLLM importance-sampling correction.

TRL's options are honoured with TRL's meaning: ``loss_type`` (grpo, bnpo, dr_grpo, dapo, cispo,
sapo, luspo, vespo), ``beta``, ``epsilon``, ``epsilon_high``, ``delta``, ``importance_sampling_level``,
``top_entropy_quantile``, ``entropy_coef`` and ``use_adaptive_entropy`` (Skywork-OR1's adaptive
coefficient: ``entropy_target``, ``entropy_coef_delta``, ``entropy_coef_min``/``_max``),
``off_policy_mask_threshold`` (DeepSeek-V3.2's sequence mask, fused: `LossConfig`), the MoE
load-balancing loss (``router_aux_loss_coef``, the model's own ``load_balancing_loss_func``),
``use_bias_correction_kl``, the ``sapo_temperature_*`` and ``vespo_*`` parameters and
``vllm_importance_sampling_correction``; gradient accumulation scales as in TRL. With
``sage_guide="none"`` the loss and gradients are TRL's. Models whose logits are scaled or softcapped
after the LM head (Gemma 2/3's ``final_logit_softcapping``, Cohere's ``logit_scale`` and the other
scale keys TRL's fused head reads: `hf_logits.logit_options`) get the same logits in the fused loss
(`LossConfig.logit_scale`, ``logit_softcap``). What TRL has and this trainer does not (vision
inputs) raises ValueError rather than being silently dropped.

Known differences from TRL:
- with several processes, the top-entropy threshold is the quantile of this process's tokens
  (TRL gathers all processes' entropies first);
- the entropy bonus (TRL's mean entropy over the kept tokens) costs a second fused sweep over
  the vocabulary, since its per-token weight differs from the PG term's;
- a masked mean over no completion token (on every process) is logged as NaN, which TRL's
  ``log`` skips, not as 0.

Metrics: TRL's names (``kl``, ``entropy``, ``clip_ratio/*`` for the clipped loss types,
``cispo_clip_ratio``, ``vespo/phi_seq_mean``, ``policy_loss`` and ``entropy_coef`` with the entropy
bonus, ``aux_loss`` with the MoE loss) with TRL's semantics, plus ``sage/q_mean``, ``sage/q_min``, ``sage/q_max``.
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import trl
from packaging.version import Version

#: the TRL releases SAGEGRPOTrainer is written for, [first, first not supported): it overrides internals
#: of GRPOTrainer (`_compute_loss`, the model's forward, the metrics), tested on TRL 1.16 only. The
#: `trl` extra of pyproject.toml pins the same range.
TRL_SUPPORTED = ("1.16", "1.17")


def check_trl_version(version: str) -> None:
    """ImportError naming the supported range unless TRL `version` is in `TRL_SUPPORTED`."""
    first, beyond = TRL_SUPPORTED
    if not Version(first) <= Version(version) < Version(beyond):
        raise ImportError(
            f"sage_kernels.integrations.trl supports trl>={first},<{beyond} (SAGEGRPOTrainer overrides "
            f"GRPOTrainer internals, tested on TRL {first}), found trl {version}: pip install 'sage-rl[trl]'"
        )


check_trl_version(trl.__version__)  # before the names below, which other releases may not have

from accelerate.utils import is_peft_model  # noqa: E402
from transformers.utils import ModelOutput  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanmax, nanmin  # noqa: E402

from ..function import fused_linear_sage_loss  # noqa: E402
from ..loss_types import LOSS_TYPES  # noqa: E402
from ..metrics import EXTREME_METRICS, METRIC_NAME  # noqa: E402
from ..reference import vespo_weight  # noqa: E402
from ..spec import LossConfig  # noqa: E402
from .hf_logits import logit_options  # noqa: E402

#: TRL's option names for the `LossConfig` fields they share.
_SHARED_OPTIONS = (
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "use_bias_correction_kl",
)
_DEFAULTS = LossConfig()
_VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes")


@dataclass
class SAGEGRPOConfig(GRPOConfig):
    """`GRPOConfig` plus the SAGE options (defaults: the official SAGE code's branch guide).

    sage_guide: "branch" (q = clamp(1 + gamma * (H - tau)+, q_min, q_max) from the policy's
    entropy H) or "none" (q = 1: TRL's GRPO loss). The guide acts through the KL term, so it
    needs ``beta`` > 0. sage_kl: KL estimator, "k3" (TRL's), "k2" or "k1".
    sage_dual_clip_c: PPO dual clip (> 1) for negative advantages, or None.
    sage_backend: the fused loss's backend ("auto", "cpu", "triton", "reference").
    beta defaults to 0.05 and use_bias_correction_kl to False here (TRL: 0 and True); see the fields.
    """

    sage_guide: str = field(default=_DEFAULTS.guide, metadata={"help": "'branch' or 'none'."})
    sage_gamma: float = field(default=_DEFAULTS.gamma, metadata={"help": "Branch guide slope per nat above tau."})
    sage_tau: float = field(default=_DEFAULTS.tau, metadata={"help": "Branch guide entropy threshold, in nats."})
    sage_q_min: float = field(default=_DEFAULTS.q_min, metadata={"help": "Lower clamp of q."})
    sage_q_max: float = field(default=_DEFAULTS.q_max, metadata={"help": "Upper clamp of q."})
    sage_kl: str = field(default=_DEFAULTS.kl, metadata={"help": "KL estimator: 'k1', 'k2' or 'k3'."})
    sage_dual_clip_c: float | None = field(default=None, metadata={"help": "PPO dual clip (> 1)."})
    sage_backend: str = field(default="auto", metadata={"help": "Fused loss backend."})
    # TRL >= 1 defaults to True; the official SAGE code has no ratio-weighted KL, so the default
    # here is the loss's own (False). Set it to True for TRL's default behaviour.
    use_bias_correction_kl: bool = field(
        default=_DEFAULTS.use_bias_correction_kl, metadata={"help": "Multiply the per-token KL by the ratio (TRL's)."}
    )
    # TRL defaults to beta = 0 (no KL term); the guide acts through the KL term, so SAGE's default is kept.
    beta: float = field(default=_DEFAULTS.beta, metadata={"help": "KL coefficient (SAGE's default 0.05; TRL's is 0)."})


@dataclass
class HeadOutput(ModelOutput):
    """What the model returns when called with ``sage_head=fn``: fn's result and the MoE
    load-balancing loss (None unless ``output_router_logits=True``)."""

    result: object | None = None
    aux_loss: torch.Tensor | None = None


def add_fused_head(model) -> None:
    """Let ``model(..., sage_head=fn)`` return ``fn(last hidden states, LM head weight, bias)``
    without computing logits. fn returns ``(tensors, extra)``: the tensors the backward goes through
    (None allowed) and anything else. fn runs as the LM head module's own forward (`_as_forward_of`),
    inside the model's forward: under DeepSpeed ZeRO-3, whose parameters are materialized only in
    their owning module's forward and backward, the head's hooks gather its weight for fn, gather it
    again for fn's backward (through the returned tensors) and reduce its gradient; under FSDP2 the
    head's ``fully_shard`` unit hands fn the whole weight (a plain tensor, not its DTensor shard) and
    reduce-scatters its gradient. Called through the (possibly wrapped) model so DDP, FSDP2,
    DeepSpeed and PEFT see an ordinary forward."""
    inner_forward = model.forward

    def forward(self, *args, sage_head=None, **kwargs):
        if sage_head is None:
            return inner_forward(*args, **kwargs)
        outputs = self.base_model(*args, use_cache=False, **kwargs)
        head = self.get_output_embeddings()
        aux_loss = None
        if kwargs.get("output_router_logits"):  # the model's own load-balancing loss, as its causal-LM forward forms it
            balance = sys.modules[type(self).__module__].load_balancing_loss_func
            mask = kwargs.get("attention_mask")
            aux_loss = balance(outputs.router_logits, self.num_experts, self.num_experts_per_tok, mask)
        extra = {}

        def head_forward(hidden_states):
            tensors, extra["value"] = sage_head(hidden_states, head.weight, head.bias)
            return tuple(tensors)

        with _as_forward_of(head, head_forward):
            tensors = head(outputs.last_hidden_state)  # the module's hooks wrap these for the backward
        return HeadOutput(result=(tensors, extra["value"]), aux_loss=aux_loss)

    model.forward = types.MethodType(forward, model)


@contextmanager
def _as_forward_of(module, forward):
    """`module` called runs `forward` instead of its own, for the block (a forward set on the
    instance before, as wrappers do, is put back after)."""
    previous = vars(module).get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del module.forward  # the class's forward again
        else:
            module.forward = previous


class SAGEGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose loss is the fused SAGE loss. Takes `GRPOTrainer`'s arguments; `args`
    must be a `SAGEGRPOConfig`."""

    def __init__(self, model, reward_funcs=None, args: SAGEGRPOConfig | None = None, **kwargs):
        if args is not None and not isinstance(args, SAGEGRPOConfig):
            raise TypeError(f"args must be a SAGEGRPOConfig, got {type(args).__name__}")
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = SAGEGRPOConfig(f"{name.split('/')[-1]}-SAGE-GRPO")
        _check_supported(args)
        super().__init__(model, reward_funcs, args=args, **kwargs)
        base = self.model.get_base_model() if is_peft_model(self.model) else self.model
        _check_model(base, self.aux_loss_enabled)
        # the model's own scale and softcap of its logits, read once: the loss forms the same logits
        self._logit_options = logit_options(base.config)
        add_fused_head(base)
        # Validate the SAGE options now rather than at the first step.
        self._loss_config(num_items_in_batch=None)

    def _loss_config(self, num_items_in_batch) -> LossConfig:
        args = self.args
        return LossConfig(
            beta=self.beta,
            kl=args.sage_kl,
            guide=args.sage_guide,
            gamma=args.sage_gamma,
            tau=args.sage_tau,
            q_min=args.sage_q_min,
            q_max=args.sage_q_max,
            loss_type=self.loss_type,
            eps_low=self.epsilon_low,
            eps_high=self.epsilon_high,
            delta_clip=args.delta,
            dual_clip_c=args.sage_dual_clip_c,
            importance_sampling=self.importance_sampling_level,
            top_entropy_quantile=self.top_entropy_quantile,
            temperature=self.temperature,
            **self._logit_options,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=num_items_in_batch,
            off_policy_mask_threshold=self.off_policy_mask_threshold,
            **{name: getattr(args, name) for name in _SHARED_OPTIONS},
        )

    def _compute_loss(self, model, inputs):
        if any(key in inputs for key in _VISION_KEYS):
            raise ValueError("SAGEGRPOTrainer supports text-only models")
        completion_ids = inputs["completion_ids"]
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            mask = mask & inputs["tool_mask"].bool()
        B, L = completion_ids.shape
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_items = None
        # TRL divides these by the generation batch's token count (already covering accumulation)
        given_count = LOSS_TYPES[self.loss_type].normaliser == "given_tokens"
        if given_count:
            # TRL's dapo divisor: the generation batch's token count, per process and accumulation window.
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * accumulation / self.args.steps_per_generation
        is_weights = None
        ratio = inputs.get("importance_sampling_ratio")
        # TRL's vespo folds the vLLM ratios (1 at masked positions) into its weight whenever the batch has them.
        correcting = self.use_vllm and self.vllm_importance_sampling_correction
        if ratio is not None and (self.loss_type == "vespo" or correcting):
            is_weights = ratio.reshape(B, -1).expand(B, L)
        # the entropy bonus's coefficient (and gate): the previous optimizer step's, for its whole window
        coef = self.entropy_coef if self._entropy_bonus_enabled else 0.0
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            coef = 0.0

        def head_loss(hidden_states, weight, bias):
            """Both fused calls, as the LM head's forward (where ZeRO-3 has gathered the head); returns
            the losses the backward goes through, then what the metrics read."""
            # The LM head runs in the autocast dtype, as TRL's fused head does, unless told to stay in fp32.
            device_type, dtype = weight.device.type, weight.dtype
            if torch.is_autocast_enabled(device_type) and not self.args.cast_lm_head_to_fp32:
                dtype = torch.get_autocast_dtype(device_type)
            weight = weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
            # Position t predicts token t + 1: the last L + 1 positions but one predict the completion.
            hidden = hidden_states[:, -L - 1 : -1].to(dtype)
            with torch.autocast(device_type, enabled=False):  # the loss keeps its own precision rules
                out = fused_linear_sage_loss(
                    hidden,
                    weight,
                    completion_ids,
                    mask,
                    inputs["advantages"],
                    bias=bias,
                    old_logp=inputs.get("old_per_token_logps"),
                    ref_logp=inputs["ref_per_token_logps"] if self.beta != 0.0 else None,
                    is_weights=is_weights,
                    # the off-policy mask's behaviour policy: the sampler's log-probs (vLLM's), else old_logp
                    sampling_logp=inputs.get("sampling_per_token_logps")
                    if self.off_policy_mask_threshold is not None
                    else None,
                    config=self._loss_config(num_items),
                    backend=self.args.sage_backend,
                )
                kept = mask
                if self.top_entropy_quantile < 1.0:
                    kept = kept & self.get_high_entropy_mask(out.entropy, mask, 1 - self.top_entropy_quantile)
                bonus = None
                if coef != 0.0:  # a zero bonus adds nothing to the loss or the gradients: no second sweep
                    bonus = self._entropy_bonus(hidden, weight, bias, completion_ids, kept, coef / accumulation)
            return (out.loss, bonus), (out, kept)

        with self.accelerator.autocast():
            head = model(
                input_ids=torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
                attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                sage_head=head_loss,
                **(dict(output_router_logits=True) if self.aux_loss_enabled else {}),
            )
        (policy_loss, bonus), (out, kept) = head.result  # the losses as the head module returned them
        # TRL scales every loss type but the token-count ones (whose divisor covers the window) for accumulation.
        loss = policy_loss if given_count else policy_loss / accumulation
        if bonus is not None:
            loss = loss + bonus
        if self._entropy_bonus_enabled:
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(out.loss.detach()).nanmean().item())
            if self.use_adaptive_entropy and mode == "train":
                self._update_entropy_coef(out.entropy, kept)
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * head.aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(head.aux_loss).mean().item())
        self._log_loss_metrics(mode, out, inputs["advantages"], mask)
        if self.loss_type == "vespo":
            self._log_vespo_weight(mode, out, inputs, mask, is_weights)
        return loss

    def _log_vespo_weight(self, mode, out, inputs, mask, is_weights) -> None:
        """TRL's ``vespo/phi_seq_mean``: the mean over sequences of VESPO's weight phi."""
        old = inputs.get("old_per_token_logps")
        log_ratio = torch.zeros_like(out.logp) if old is None else torch.where(mask, out.logp - old, 0.0)
        A = inputs["advantages"]
        phi = vespo_weight(log_ratio, A[:, None] if A.dim() == 1 else A, mask, is_weights, self._loss_config(None))
        rows = phi.reshape(phi.shape[0], -1)[:, 0] if A.dim() == 1 else (phi * mask).sum(-1) / mask.sum(-1)
        totals = self.accelerator.reduce(torch.stack([rows.sum(), torch.tensor(float(rows.numel()))]), reduction="sum")
        self._metrics[mode]["vespo/phi_seq_mean"].append((totals[0] / totals[1].clamp(min=1.0)).item())

    def _update_entropy_coef(self, entropy: torch.Tensor, kept: torch.Tensor) -> None:
        """Skywork-OR1's adaptive coefficient, TRL's controller: the entropy of every micro-batch of the
        accumulation window is summed; at the optimizer step the window's mean over all processes
        raises the coefficient by entropy_coef_delta when at most entropy_target, lowers it
        otherwise, within [entropy_coef_min, entropy_coef_max]."""
        stats = torch.stack([(entropy * kept).sum(), kept.sum().to(entropy.dtype)]).detach()
        window = self._entropy_window_stats
        self._entropy_window_stats = stats if window is None else window + stats
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
        args = self.args
        if world_entropy <= args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    def _entropy_bonus(self, hidden, weight, bias, token_ids, kept, coef: float) -> torch.Tensor:
        """-coef * (mean entropy over the kept tokens), TRL's bonus (coef already divided for
        accumulation), differentiable.

        A second fused call with zero advantages and no KL leaves only the entropy term; bnpo
        aggregation makes it the mean over `kept`."""
        config = LossConfig(
            beta=0.0,
            guide="none",
            loss_type="bnpo",
            temperature=self.temperature,
            **self._logit_options,
            entropy_coef=coef,
        )
        zeros = torch.zeros(token_ids.shape[0], device=hidden.device, dtype=torch.float32)
        return fused_linear_sage_loss(
            hidden, weight, token_ids, kept, zeros, bias=bias, config=config, backend=self.args.sage_backend
        ).loss

    def _log_loss_metrics(self, mode: str, out, advantages: torch.Tensor, mask: torch.Tensor) -> None:
        """TRL's loss metrics, with TRL's semantics, from the fused call's per-token outputs."""
        metrics = self._metrics[mode]
        m = mask.float()

        def global_mean(total: torch.Tensor, count: torch.Tensor) -> float:
            """The mean over all processes; NaN (no value, skipped by TRL's `log`) without any count."""
            totals = self.accelerator.reduce(torch.stack([total.float(), count.float()]), reduction="sum")
            return (totals[0] / totals[1]).item() if totals[1] > 0 else float("nan")

        if self.beta != 0.0:
            metrics[METRIC_NAME.kl].append(global_mean((out.kl * m).sum(), m.sum()))
        metrics[METRIC_NAME.entropy].append(global_mean((out.entropy * m).sum(), m.sum()))
        metrics[METRIC_NAME.q].append(global_mean((out.q * m).sum(), m.sum()))
        for name, reduction in EXTREME_METRICS.items():
            reduce = nanmin if reduction == "min" else nanmax
            metrics[name].append(reduce(self.accelerator.gather(out.metrics[name].reshape(1))).item())

        A = advantages[:, None] if advantages.dim() == 1 else advantages
        if self.loss_type == "cispo":
            clipped = ((out.ratio > self.epsilon_high) & (A > 0)).float()
            metrics["cispo_clip_ratio"].append(global_mean((clipped * m).sum(), m.sum()))
        if not LOSS_TYPES[self.loss_type].clipped:
            return
        ratio = out.ratio if self.args.delta is None else out.ratio.clamp(max=self.args.delta)
        if self.importance_sampling_level == "sequence":
            # One ratio per sequence (TRL's [B, 1]); a sequence without tokens has ratio 1.
            count = m.sum(-1, keepdim=True)
            ratio = torch.where(count > 0, (ratio * m).sum(-1, keepdim=True) / count.clamp(min=1.0), 1.0)
            weights = torch.ones_like(ratio)
        else:
            weights = m
        low = ((ratio < 1 - self.epsilon_low) & (A < 0)).float()
        high = ((ratio > 1 + self.epsilon_high) & (A > 0)).float()
        for name, clipped in (
            (METRIC_NAME.low, low),
            (METRIC_NAME.high, high),
            (METRIC_NAME.region, torch.maximum(low, high)),
        ):
            metrics[name].append(global_mean((clipped * weights).sum(), weights.sum()))
        per_sequence = (low * weights).sum(-1) / weights.sum(-1), (high * weights).sum(-1) / weights.sum(-1)
        metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(per_sequence[0])).item())
        metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(per_sequence[1])).item())


def _check_supported(args: SAGEGRPOConfig) -> None:
    """Reject the TRL options this trainer does not implement, before any model is loaded."""
    trl_loss_types = [name for name in LOSS_TYPES if name != "gmpo"]  # TRL 1.16 has no gmpo to map it to
    if args.loss_type not in trl_loss_types:
        raise ValueError(
            f"SAGEGRPOTrainer does not support loss_type={args.loss_type!r} (loss types: {', '.join(trl_loss_types)})"
        )
    if args.sage_guide != "none" and args.beta == 0.0:
        raise ValueError(
            f"sage_guide={args.sage_guide!r} acts through the KL term: set beta > 0, "
            f"or sage_guide='none' for TRL's loss"
        )


def _check_model(model, aux_loss_enabled: bool) -> None:
    if aux_loss_enabled:
        balance = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
        if balance is None or not all(hasattr(model, name) for name in ("num_experts", "num_experts_per_tok")):
            raise ValueError(
                f"SAGEGRPOTrainer finds no load-balancing loss for {type(model).__name__} (its module's "
                f"load_balancing_loss_func, num_experts, num_experts_per_tok); set router_aux_loss_coef=0"
            )
