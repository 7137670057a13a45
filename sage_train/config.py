"""TrainConfig: one flat, typed config for a training run.

Sources, later ones winning: the field defaults below, a YAML file (``--config FILE``, or
the name of a packaged config such as ``tiny-cpu``), then ``--key=value`` overrides (`parse_args`;
`load` takes them as a mapping). Unknown keys and values of the wrong type fail with a message
naming the key and the expected type; ranges and cross-key rules are `config_rules.validate`'s.
The loss options are the fields of `sage_kernels.LossConfig` (`LOSS_KEYS`), so a new loss option
is a trainer key without a line here; likewise the token and random guides' ``guide_*`` keys are the
fields of `guide.GuideSettings` (`GUIDE_KEYS`). Keys left as None take the algorithm preset's value
(`presets.py`); `resolve` fills them in, and the resolved config is what gets saved in
``runs/<name>/config.yaml`` and in every checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from sage_kernels import LossConfig

from . import config_files
from .config_rules import validate
from .errors import ConfigError
from .guide import GuideSettings
from .presets import LOSS_KEYS, PresetError, apply_preset

DEFAULT_CONFIG = "tiny-cpu"
#: the packaged config a run without ``--config`` starts from when ``--model`` is not "tiny": a real
#: model recipe (LoRA, the tokenizer's chat template, answers of a few sentences), never tiny-cpu's
#: settings for a character-level model trained from scratch (3000 SFT steps, 8 new tokens, no template)
REAL_MODEL_CONFIG = "smollm2-arithmetic"


@dataclass
class RunOptions:
    """Every key of a run except the loss options and the guide settings, which `TrainConfig` adds
    from `LossConfig` and `GuideSettings`."""

    # run
    name: str = "tiny-arithmetic-sage"
    output_dir: str = "runs"
    seed: int = 0
    resume: bool = False  # continue the run in output_dir/name from its newest complete checkpoint
    overwrite: bool = False  # a fresh run may delete the checkpoints and final model of a run of the same name

    # model: "tiny" builds a Qwen2-style model from the tiny_* keys; a named model shipped by a package
    # (models.loading.NAMED_MODELS: smollm2-135m-instruct), a local .gguf file, a hub name or a local path
    model: str = "tiny"
    gguf_file: str = ""  # a GGUF file inside the `model` directory (or an absolute path), converted once
    tiny_hidden_size: int = 64
    tiny_layers: int = 2
    tiny_heads: int = 4
    tiny_kv_heads: int = 2
    tiny_intermediate_size: int = 128
    tiny_max_positions: int = 256

    # LoRA through peft (sage_train/models/lora.py): 0 trains every weight; > 0 trains an adapter of this
    # rank only, the LM head frozen, and the reference is the base model with the adapter disabled
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: list = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )

    # task (sage_train.tasks registry) and its options
    task: str = "arithmetic"
    task_options: dict = field(default_factory=dict)
    eval_task: str = ""  # "" evaluates on `task`'s test split
    # RL prompts: the first N training problems (0: the task's pool; the synthetic tasks give 1000, or N when larger)
    train_problems: int = 0

    # supervised warm start (plain AdamW, identical on every rank, before the RL engine exists)
    sft_steps: int = 0
    sft_batch_size: int = 32
    sft_lr: float = 3e-3
    sft_target_loss: float = 0.0  # stop the warm start early once its mean token loss is below this (0: off)
    sft_max_tokens: int = 0  # completions longer than this are cut for the warm start (0: no cut)
    sft_task: str = ""  # the warm start's dataset ("": `task`), e.g. openmathreasoning-mini
    sft_epochs: int = 0  # > 0: passes over the examples (shuffled per epoch) instead of sft_steps batches
    sft_lr_schedule: str = "cosine"  # to 0 over the warm start: "cosine" or "linear" (the official one)
    sft_warmup_steps: int = 0
    sft_weight_decay: float = 0.0
    # "raw": the task's worked solutions as they are; "official": the official SAGE target
    # (tasks.chat.official_sft_completion) and only examples with a numeric answer
    sft_format: str = "raw"
    sft_max_example_tokens: int = 0  # examples (prompt + completion) longer are dropped (0: none)
    # with LoRA: "continue" RL trains on the warm start's adapter, so the reference (adapter off) is
    # the raw base (the official SAGE way); "merge" merges it, and the reference is the SFT model
    sft_adapter: str = "merge"

    # RL
    algorithm: str = "sage-branch"
    steps: int = 100
    prompts_per_step: int = 8
    group_size: int = 8
    micro_batch_size: int = 16
    # > 0: micro-batches by a budget of tokens (prompt + completion, padding not counted) instead of
    # micro_batch_size rows, long and short sequences dealt evenly (verl's dynamic batch size)
    max_tokens_per_micro_batch: int = 0
    # each micro-batch's sequences packed into one row, positions restarting per sequence, attention
    # kept within each (`sage_train.micro_batches`): no padding computed. null: packed where the
    # attention skips pairs across sequences (flash-attention's varlen, flex attention), padded under
    # sdpa and eager (a dense mask over the packed row costs more than the padding) unless each
    # micro-batch is one sequence (micro_batch_size 1, no token budget: no mask at all); true: packed
    # wherever the model keeps sequences apart (`sage_train.models.loading.packs_sequences`)
    padding_free: bool | None = None
    # activation checkpointing of the policy's decoder layers in the update (`policy.checkpoint_layers`):
    # one layer's activations held instead of all, for a second forward in the backward; same gradient
    gradient_checkpointing: bool = False
    num_iterations: int = 1
    # optimizer steps fed by one generation of prompts_per_step x steps_per_generation prompts (its
    # rows shuffled, log-probs fixed at generation, so later steps are off-policy: TRL's option)
    steps_per_generation: int = 1
    lr: float = 1e-3
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # a step whose loss or gradient norm is not finite skips its optimizer step; this many in a row stop the run
    max_nonfinite_steps: int = 3

    # sampling (the loss's temperature is the sampling temperature)
    rollout_engine: str = "hf"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 16
    stop: list = field(default_factory=list)
    max_prompt_length: int = 0  # prompts longer than this many tokens lose their start (0: no limit)
    # prompts through a chat template (tasks/chat.py), for SFT, RL and evaluation alike: "" none,
    # "tokenizer" the tokenizer's own, "official" the official SAGE template for base models (saved
    # with the tokenizer); system_prompt: "" none, a name in tasks.chat.SYSTEM_PROMPTS, or the text
    chat_template: str = ""
    system_prompt: str = ""

    # rollout engines (rollout/): "hf" samples from the live training model; "vllm" a colocated
    # vllm.LLM fed the policy's weights after every optimizer step; "openai" an external server
    vllm_gpu_memory_utilization: float = 0.3
    vllm_sleep_mode: bool = True
    vllm_sync_bucket_mb: int = 512
    vllm_max_model_len: int = 0  # 0: prompt + max_new_tokens of the longest eval / RL setting
    vllm_max_num_batched_tokens: int = 4096  # tokens per engine step (as TRL: the memory profiler); 0: vLLM's
    vllm_dtype: str = "bfloat16"
    # hf engine: the parameters' dtype to sample with ("": the model's own); "bfloat16" samples from a
    # copy refreshed at every generation, several times faster on CPUs with AVX-512 BF16 / AMX
    hf_rollout_dtype: str = ""
    openai_base_url: str = ""  # e.g. http://host:8000 (vllm serve ... --enable-lora)
    openai_model: str = ""  # the served model's name ("": the `model` key)
    openai_shared_dir: str = ""  # where adapters are saved for the server to load
    # the rollout-mismatch toolkit between the rollout engine's and the trainer's log-probs
    # (sage_train.rl_maths): truncated importance sampling, min(r, tis_cap) per token or sequence
    tis_level: str = "off"  # "token", "sequence" (the product of its token ratios, as TRL and verl) or "off"
    tis_cap: float = 2.0
    # TRL 1.16's modes ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    # and bounds [clip_min, clip_max] (None: unbounded on that side); both bounds with token_mask: IcePop
    vllm_importance_sampling_mode: str = "off"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0
    # verl's rejection sampling: "" off, or options such as "token_k1,seq_mean_k3", and their thresholds
    rollout_rs: str = ""
    rollout_rs_threshold: str | float = ""

    # loss options: one key per field of sage_kernels.LossConfig (`LOSS_KEYS`, added below the class)
    loss_backend: str = "auto"

    # SAGE's objective through the reward (rl_maths.py; presets *-exact, grpo-kl-in-reward): at
    # generation, beta times each completion's KL to q * pi_ref (k1: sum of log pi_old - log pi_ref
    # - log q) comes off its reward before the group advantages, and the loss's beta is 0
    kl_in_reward: bool | None = None
    kl_in_reward_length_normalized: bool = False  # that KL averaged over the completion's tokens, not summed

    # DAPO's batch shaping
    dynamic_sampling: bool | None = None
    dynamic_sampling_max_rounds: int = 3
    overlong_filter: bool | None = None
    scale_rewards: bool | None = None  # advantages (r - mean) / (std + 1e-4); False: r - mean

    # engine
    zero_stage: int = 0
    deepspeed_config: str = ""  # a DeepSpeed JSON/YAML file merged over the generated config
    bf16: bool = True  # on GPU; CPU runs stay in float32
    cpu_threads: int = 0  # torch intra-op threads per process on CPU; 0 keeps torch's default

    # evaluation before and after RL
    eval_splits: list = field(default_factory=lambda: ["train", "test"])  # "train": the RL prompts; "test": held out
    eval_problems: int = 32
    # the seed that draws the held-out problems ("test"); null: the run's seed. Fixed, every seed of
    # a recipe evaluates the same problems, so seeds and problems are crossed factors of its results
    held_out_seed: int | None = None
    eval_samples: int = 8
    eval_temperature: float = 1.0
    eval_max_new_tokens: int = 0  # 0: max_new_tokens

    # logging and checkpoints
    log_every: int = 1
    save_every: int = 50
    keep_checkpoints: int = 2
    plots: bool = True
    report_to: list = field(default_factory=list)  # experiment loggers: "tensorboard", "wandb", "trackio"
    report_project: str = "sage"  # the wandb / trackio project (the run is `name`)
    progress: bool = True
    # the texts of each step's first N groups (prompt, completions, rewards) to runs/<name>/completions.jsonl (0: off)
    log_completions: int = 0

    @property
    def warm_start(self) -> bool:
        """Whether a supervised warm start runs (``sft_steps`` or ``sft_epochs``)."""
        return self.sft_steps > 0 or self.sft_epochs > 0

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir).expanduser() / self.name  # "~/runs" is the home folder's

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _loss_option_fields() -> list:
    """(name, type | None, None) for each key of `LOSS_KEYS`: None takes the preset's value."""
    hints = typing.get_type_hints(LossConfig)
    return [(name, hints[name] | None, field(default=None)) for name in LOSS_KEYS]


def _guide_setting_fields() -> list:
    """(guide_<name>, type | None, None) for each field of `GuideSettings`: None takes the preset's value."""
    hints = typing.get_type_hints(GuideSettings)
    return [(f"guide_{f.name}", hints[f.name] | None, field(default=None)) for f in dataclasses.fields(GuideSettings)]


#: the run's keys: `RunOptions`, one key per loss option and one per guide setting (their own lists,
#: not copies of them)
TrainConfig = dataclasses.make_dataclass(
    "TrainConfig",
    _loss_option_fields() + _guide_setting_fields(),
    bases=(RunOptions,),
    namespace={
        "__module__": __name__,
        "__doc__": "A run's config: `RunOptions` plus the loss options and the guide settings.",
    },
)


_FLOAT = re.compile(r"[-+]?((?:0|[1-9]\d*)(?:\.\d*)?|\.\d+)([eE][-+]?\d+)?")  # no leading zero: "010" is 8 to YAML 1.1


def decimal_int(text: str) -> int:
    """`text` as an integer in plain decimal digits, for argparse options and comma-separated lists;
    argparse.ArgumentTypeError otherwise (Python's int() also reads "1_000" and other scripts' digits)."""
    if not re.fullmatch(r"\s*[-+]?[0-9]+\s*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is no integer in plain decimal digits")
    return int(text)


def decimal_float(text: str) -> float:
    """`text` as a number in plain decimal digits ("0.3", "1e-3"), for argparse options;
    argparse.ArgumentTypeError otherwise (Python's float() also reads "1_0.5")."""
    if not _FLOAT.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is no number in plain decimal digits")
    return float(text)


#: a number as YAML 1.1 writes it and `config_files` reads as text ("1_000", "0x1f", "010", "1:30")
_NUMBER_LIKE = re.compile(r"[-+]?(?:0[xob][0-9a-fA-F_]+|[0-9][0-9_:.]*)")
FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)


def _type_name(hint) -> str:
    if isinstance(hint, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _coerce(key: str, value):
    """`value` checked against the type of field `key` (ints accepted where floats are)."""
    hint, allowed = _HINTS[key], _allowed(key)
    for kind in allowed:
        if kind is type(None) and value is None:
            return None
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is float and isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads "1e-3" (no dot) as a string
        if kind is float and isinstance(value, str) and value.strip().lower().lstrip("+-.") in ("nan", "inf"):
            raise ConfigError(f"config key {key!r} must be a finite number, got {value!r}")
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind in (str, bool, list, dict) and isinstance(value, kind):
            return value
    # what YAML 1.1 would have read as a number or a boolean, and `config_files` leaves as text
    if isinstance(value, str) and (int in allowed or float in allowed) and _NUMBER_LIKE.fullmatch(value.strip()):
        raise ConfigError(
            f"config key {key!r} must be {_type_name(hint)}, got {value!r}: write numbers in plain decimal digits "
            f"(no digit-group underscores, 0x/0o prefixes, leading zeros or 1:30 sexagesimal)"
        )
    if isinstance(value, str) and bool in allowed and value.strip().lower() in ("yes", "no", "on", "off", "y", "n"):
        raise ConfigError(f"config key {key!r} must be {_type_name(hint)}, got {value!r}: write true or false")
    raise ConfigError(f"config key {key!r} must be {_type_name(hint)}, got {value!r} ({type(value).__name__})")


def _check_keys(values: dict, source: str) -> None:
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown} in {source}; known keys: {sorted(FIELDS)}")


def parse_args(argv: list[str]) -> TrainConfig:
    """``[--config FILE] [--key=value | --key value | --flag ...]`` -> a checked, resolved TrainConfig.

    Without ``--config`` the packaged default (`DEFAULT_CONFIG`) is used, or `REAL_MODEL_CONFIG`
    when ``--model`` names another model than "tiny". Values are read as
    YAML scalars (``--lr=1e-3``, ``--stop=["\\n"]``, ``--beta=null``); a bare ``--flag`` means true.
    ``--local_rank``, which the deepspeed launcher adds, is accepted and ignored.
    """
    config_file, overrides = None, {}
    args = list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; expected --config FILE or --key=value")
        key, has_value, text = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not has_value:
            if args and not args[0].startswith("--"):
                text = args.pop(0)
            elif key in FIELDS and _HINTS[key] is bool:
                text = "true"
            else:
                raise ConfigError(f"--{key} needs a value (--{key}=VALUE)")
        if key == "config":
            config_file = text
            continue
        if key == "local_rank":  # passed by the deepspeed launcher; LOCAL_RANK in the environment says the same
            continue
        overrides[key] = command_line_value(key, text)
    return load(config_file, overrides)


def load(config_file: str | None, overrides: dict | None = None) -> TrainConfig:
    """The checked, resolved TrainConfig of a YAML file or packaged config name (None: the default,
    as `parse_args` chooses it) with `overrides` (keys to values) on top."""
    overrides = dict(overrides or {})
    _check_keys(overrides, "the overrides")
    if config_file is None:
        config_file = DEFAULT_CONFIG if overrides.get("model", "tiny") == "tiny" else REAL_MODEL_CONFIG
    texts: dict = {}
    values = config_files.read_mapping(config_file, texts)
    _check_keys(values, f"config file {config_file!r}")
    values = {key: _typed(key, value, texts[key]) if key in texts else value for key, value in values.items()}
    values.update(overrides)
    return resolve(build(values))


def command_line_value(key: str, text: str):
    """The value of ``--key=text`` by the key's declared type: YAML (`config_files.load`), except that
    a key that takes a string keeps, as given, any text that does not read as a YAML string or as
    another type the key takes (a name like "123", "on", "1e-3" or "[draft"; "null" where the key
    may be None). An unknown key raises ConfigError."""
    _check_keys({key: None}, "the command line")
    if str not in _allowed(key):
        return config_files.load(text, f"--{key}") if text != "" else ""
    try:
        value = config_files.load(text, f"--{key}")
    except config_files.YamlDataError:
        return text
    return _typed(key, value, text)


def _allowed(key: str) -> tuple:
    """The types key `key` takes."""
    hint = _HINTS[key]
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def _typed(key: str, value, text: str):
    """`value`, read as YAML from `text`, by the type of key `key`: for a key that takes a string,
    `text` itself unless `value` is a string or of another type the key takes (a float, or None)."""
    allowed = _allowed(key)
    if str not in allowed:
        return value
    if isinstance(value, str) or (value is None and type(None) in allowed):
        return value
    if isinstance(value, float) and float in allowed:
        return value
    return text


def build(values: dict) -> TrainConfig:
    """A TrainConfig from a mapping, type-checked; unknown keys fail."""
    _check_keys(values, "the config")
    config = TrainConfig(**{key: _coerce(key, value) for key, value in values.items()})
    validate(config)
    return config


def resolve(cfg: TrainConfig) -> TrainConfig:
    """Fill the None loss options from the algorithm preset and check the loss options."""
    try:
        return apply_preset(cfg)
    except PresetError as error:
        raise ConfigError(str(error)) from error


def load_yaml(path) -> TrainConfig:
    """A saved, resolved config (e.g. from a checkpoint)."""
    return build(config_files.read(path))
