"""The rules a `TrainConfig` must follow beyond its types: ranges, choices and cross-key rules; a
config that breaks one is a `ConfigError` naming the key."""

from __future__ import annotations

import math
import os
from pathlib import Path

from sage_kernels.backends import BACKEND_CHOICES

from .errors import ConfigError
from .eval.evaluate import EVAL_SPLITS
from .optim import LR_SCHEDULES, ZERO_STAGES
from .presets import LOSS_KEYS
from .records import settings_of
from .report import LOGGERS
from .rl_maths import IS_MODES, TIS_LEVELS, Corrections, parse_rejection
from .rollout.base import ENGINES, HF_ROLLOUT_DTYPES
from .sft import SFT_ADAPTERS, SFT_FORMATS, SFT_LR_SCHEDULES
from .tasks.chat import CHAT_TEMPLATES

#: the longest file name (in bytes) the filesystems sage writes to take
NAME_MAX = 255
#: the longest run directory path (in bytes, absolute): the kernel's PATH_MAX (4096) less room for
#: the longest path a run writes inside it (a DeepSpeed checkpoint's files under a staging folder)
RUN_DIR_MAX = 4096 - 512

#: integer keys that must be positive, and those that may also be 0 (0: off / all / none)
POSITIVE_KEYS = (
    "steps prompts_per_step micro_batch_size num_iterations steps_per_generation max_new_tokens eval_samples "
    "log_every save_every dynamic_sampling_max_rounds tiny_hidden_size tiny_layers tiny_heads tiny_kv_heads "
    "tiny_intermediate_size tiny_max_positions sft_batch_size max_nonfinite_steps"
).split()
NON_NEGATIVE_KEYS = (
    "sft_steps sft_max_tokens sft_epochs sft_warmup_steps sft_max_example_tokens cpu_threads train_problems "
    "warmup_steps eval_problems eval_max_new_tokens max_prompt_length keep_checkpoints log_completions"
).split()
#: the keys that take one of a few values, and those values, each read from the table that defines
#: it (a new engine, correction, backend, schedule or template is one entry there)
CHOICES = {
    "zero_stage": ZERO_STAGES,
    "lr_schedule": LR_SCHEDULES,
    "rollout_engine": tuple(ENGINES),
    "sft_adapter": SFT_ADAPTERS,
    "sft_lr_schedule": SFT_LR_SCHEDULES,
    "sft_format": SFT_FORMATS,
    "tis_level": TIS_LEVELS,
    "vllm_importance_sampling_mode": IS_MODES,
    "loss_backend": BACKEND_CHOICES,
    "chat_template": ("", *CHAT_TEMPLATES),  # "": none
    "hf_rollout_dtype": HF_ROLLOUT_DTYPES,
}


def check_rollout_correction(corrections: Corrections, require) -> None:
    """The rollout-mismatch keys (`sage_train.rl_maths.Corrections`): one weighting at a time, TRL's
    bounds, verl's rejection options and thresholds."""
    mode = corrections.vllm_importance_sampling_mode
    require(
        mode == "off" or corrections.tis_level == "off",
        "vllm_importance_sampling_mode",
        f"'off' with tis_level {corrections.tis_level!r} (tis_level 'token' is token_truncate at clip_max tis_cap)",
    )
    low, high = corrections.vllm_importance_sampling_clip_min, corrections.vllm_importance_sampling_clip_max
    require(
        mode == "off" or low is not None or high is not None,
        "vllm_importance_sampling_clip_max",
        "a number when vllm_importance_sampling_clip_min is null (a mode needs a bound)",
    )
    require(
        low is None or high is None or low < high,
        "vllm_importance_sampling_clip_min",
        f"< vllm_importance_sampling_clip_max={high}",
    )
    require(
        corrections.rollout_rs or corrections.rollout_rs_threshold == "",
        "rollout_rs_threshold",
        "'' without rollout_rs",
    )
    if corrections.rollout_rs:
        try:
            parse_rejection(corrections.rollout_rs, corrections.rollout_rs_threshold)
        except ValueError as error:  # its message starts with the key it is about
            key, _, rest = str(error).partition(" ")
            raise ConfigError(f"config key {key!r} {rest}") from None


def validate(cfg) -> None:
    """Ranges and cross-key rules, each failure naming the key and what was expected."""

    def require(ok: bool, key: str, expected: str) -> None:
        if not ok:
            raise ConfigError(f"config key {key!r} must be {expected}, got {getattr(cfg, key)!r}")

    for key, value in cfg.to_dict().items():  # NaN passes no range check below
        require(not isinstance(value, float) or math.isfinite(value), key, "a finite number")

    for key in POSITIVE_KEYS:
        require(getattr(cfg, key) > 0, key, "a positive integer")
    for key in NON_NEGATIVE_KEYS:
        require(getattr(cfg, key) >= 0, key, "an integer >= 0")
    for key, choices in CHOICES.items():
        require(getattr(cfg, key) in choices, key, "one of " + ", ".join(map(repr, choices)))
    require(cfg.group_size >= 2, "group_size", "at least 2 (advantages compare completions of one prompt)")
    require(cfg.lr > 0 and cfg.sft_lr > 0, "lr" if cfg.lr <= 0 else "sft_lr", "> 0")
    require(cfg.temperature > 0, "temperature", "> 0")
    require(cfg.sft_target_loss >= 0, "sft_target_loss", ">= 0 (0: off)")
    require(cfg.max_grad_norm >= 0, "max_grad_norm", ">= 0 (0: no clipping)")
    require(cfg.eval_temperature > 0, "eval_temperature", "> 0")
    require(0 < cfg.top_p <= 1, "top_p", "in (0, 1]")
    require(cfg.top_k >= 0, "top_k", ">= 0 (0: off)")
    require(0 <= cfg.min_p < 1, "min_p", "in [0, 1) (0: off)")
    require(cfg.lora_rank >= 0, "lora_rank", "an integer >= 0 (0: off)")
    require(cfg.sft_weight_decay >= 0, "sft_weight_decay", ">= 0")
    require(cfg.lora_alpha > 0, "lora_alpha", "> 0")
    require(0 <= cfg.lora_dropout < 1, "lora_dropout", "in [0, 1)")
    require(
        bool(cfg.lora_target_modules) and all(isinstance(m, str) and m for m in cfg.lora_target_modules),
        "lora_target_modules",
        "a non-empty list of module names",
    )
    require(0 < cfg.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization", "in (0, 1]")
    require(cfg.vllm_sync_bucket_mb > 0, "vllm_sync_bucket_mb", "a positive integer")
    require(cfg.vllm_max_model_len >= 0, "vllm_max_model_len", "an integer >= 0 (0: derived)")
    require(cfg.vllm_max_num_batched_tokens >= 0, "vllm_max_num_batched_tokens", "an integer >= 0 (0: vLLM's default)")
    require(
        cfg.rollout_engine != "openai" or cfg.openai_base_url != "",
        "openai_base_url",
        "the server's URL when rollout_engine is 'openai'",
    )
    require(
        cfg.rollout_engine != "openai" or cfg.lora_rank > 0,
        "lora_rank",
        "> 0 with rollout_engine 'openai' (only adapters are synced to a remote server)",
    )
    require(
        cfg.rollout_engine != "openai" or (cfg.model != "tiny" and cfg.sft_steps == 0),
        "rollout_engine",
        "'hf' or 'vllm' with model 'tiny' or a warm start (sft_steps > 0): the server serves `model` as it "
        "is, not the weights the adapter would be trained on (warm-start in a run of its own and point "
        "`model` at its runs/<name>/sft directory, served by the server)",
    )
    require(
        not cfg.hf_rollout_dtype or (cfg.rollout_engine == "hf" and cfg.zero_stage != 3),
        "hf_rollout_dtype",
        "'' unless rollout_engine is 'hf' without ZeRO-3 (the copy it samples from holds whole parameters; "
        "vLLM has vllm_dtype)",
    )
    check_rollout_correction(settings_of(Corrections, cfg), require)
    truncates = cfg.top_k > 0 or cfg.top_p < 1 or cfg.min_p > 0
    corrects = [key for key in ("tis_level", "vllm_importance_sampling_mode") if getattr(cfg, key) != "off"]
    corrects += ["rollout_rs"] if cfg.rollout_rs else []
    require(
        not corrects or cfg.rollout_engine == "hf" or cfg.temperature == 1.0 or not truncates,
        corrects[0] if corrects else "tis_level",
        f"'off' with rollout_engine {cfg.rollout_engine!r}, temperature {cfg.temperature} and top_k / top_p / "
        "min_p truncation: vLLM reports log-probs before truncation only at temperature 1 (raw), and its "
        "temperature-scaled ones come after the cuts, which would bias every weight by the kept mass; "
        f"use temperature 1, no truncation, or {corrects[0] if corrects else 'tis_level'} 'off'",
    )
    require(cfg.tis_cap > 0, "tis_cap", "> 0")
    require(all(isinstance(s, str) and s for s in cfg.stop), "stop", "a list of non-empty strings")
    require(cfg.chat_template or not cfg.system_prompt, "system_prompt", "'' without a chat_template")
    require(set(cfg.eval_splits) <= set(EVAL_SPLITS), "eval_splits", "a list of 'train' and/or 'test'")
    for key in ("output_dir", "name"):  # a longer folder name fails in the filesystem, not here
        fits = all(len(os.fsencode(part)) <= NAME_MAX for part in Path(getattr(cfg, key)).parts)
        require(fits and "\0" not in getattr(cfg, key), key, f"a path of names of at most {NAME_MAX} bytes")
    run_dir = os.fsencode(Path(cfg.output_dir).expanduser().absolute() / cfg.name)
    if len(run_dir) > RUN_DIR_MAX:  # the filesystem would refuse it with ENAMETOOLONG, deep inside the run
        raise ConfigError(
            f"config key 'output_dir' must make, absolute and with the run's name, a path of at most "
            f"{RUN_DIR_MAX} bytes; it makes {len(run_dir)} ({cfg.output_dir[:40]!r}...)"
        )
    plain = cfg.name not in ("", ".", "..") and "/" not in cfg.name and "\0" not in cfg.name  # and no link out:
    inside = plain and not cfg.run_dir.is_symlink() and cfg.run_dir.parent.resolve() == cfg.run_dir.resolve().parent
    require(inside, "name", "a plain folder name inside output_dir (not '.' or '..', nor a link)")
    require(cfg.beta is None or cfg.beta >= 0, "beta", ">= 0 (0: no KL term)")
    require(not (cfg.resume and cfg.overwrite), "overwrite", "false with resume (continue the run, or replace it)")
    require(
        isinstance(cfg.report_to, list) and set(cfg.report_to) <= set(LOGGERS),
        "report_to",
        f"a list of {', '.join(map(repr, LOGGERS))}",
    )
    head_dim, rest = divmod(cfg.tiny_hidden_size, cfg.tiny_heads)
    require(rest == 0, "tiny_heads", f"a divisor of tiny_hidden_size={cfg.tiny_hidden_size}")
    require(head_dim % 2 == 0, "tiny_heads", "such that tiny_hidden_size / tiny_heads is even (RoPE rotates pairs)")
    require(cfg.tiny_heads % cfg.tiny_kv_heads == 0, "tiny_kv_heads", f"a divisor of tiny_heads={cfg.tiny_heads}")
    for name in [key for key in cfg.to_dict() if key not in LOSS_KEYS]:  # last: the rules above speak first
        value = getattr(cfg, name)
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        require(not numeric or value >= 0, name, ">= 0 (no run option is signed)")
