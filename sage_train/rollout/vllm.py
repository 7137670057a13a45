"""The `vllm` rollout engine: a colocated `vllm.LLM` in the training process (`VLLMEngine`), one
per training process, as in the official SAGE code
(TRL's "colocate" mode):
- memory is shared with training through sleep mode: the engine sleeps at level 2 (weights and
  KV cache released, no CPU copy kept) right after start-up and after each generation;
  `sync_weights` wakes the weights and loads the policy's current parameters, and `generate`
  wakes the KV cache. Inside `awake()` (an evaluation, or a step's dynamic-sampling rounds) the
  engine does not sleep between generate calls, so the weights are pushed at most once for all of them;
- weights are pushed after every optimizer step in buckets of about `sync_bucket_mb`: one
  ZeRO-3 gather per bucket (`deepspeed.zero.GatheredParameters`), then
  vLLM's own `load_weights` on its model; a LoRA policy is pushed merged, W + BA computed out of
  place (the base weights are never modified; under ZeRO-3 the whole model is gathered once,
  since a merge needs a weight and its factors together); the prefix cache is reset after a
  push. `pushes` counts them; `last_sync_s` is the time of every push since the previous
  `sync_weights` returned, that sync included (a generate after a level-2 sleep pushes too),
  measured between CUDA synchronizations;
- each prompt is a request of its own with its own seed (`base.prompt_seeds`), so prompts
  never share sampling noise;
- log-probs come back for each sampled token from the temperature-scaled distribution before
  min-p / top-k / top-p truncation (`logprobs_mode_for` the sampling temperature the engine is given), the
  quantity the trainer computes, so truncated importance sampling (`sage_train.rl_maths`)
  compares like with like.

Coded against vLLM's documented Python API (`vllm.LLM`, `SamplingParams`, `LLM.sleep`,
`LLM.wake_up`, `LLM.reset_prefix_cache`, `LLM.apply_model` for the weight push), never its
internals; the supported range is pinned in the `vllm` extra. The engine joins the trainer's
torch.distributed job when there is one (`executor_backend`) and runs on vLLM's default executor
otherwise (`sage-eval`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence

import torch

from ..distributed import zero3_gathered
from ..models.lora import is_lora, merged_named_weights
from .base import Completion, SamplingParams, prompt_seeds

VLLM_MISSING = "the vllm engine needs vLLM on a CUDA machine: pip install 'sage-rl[vllm]'"


def _import_vllm():
    try:
        import vllm
    except ImportError as error:  # an optional extra
        raise ImportError(VLLM_MISSING) from error
    return vllm


def executor_backend() -> str | None:
    """vLLM's ``distributed_executor_backend``: "external_launcher" inside a torch.distributed job
    (training: one engine per process, sharing the trainer's process group), else None, vLLM's
    default executor (``sage-eval`` run as a plain command, with no RANK or WORLD_SIZE to join)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return "external_launcher" if distributed else None


def policy_weights_for_vllm(model):
    """(name, tensor) pairs of `model` named as in the Hugging Face checkpoint, a LoRA adapter
    merged out of place (`sage_train.models.lora.merged_named_weights`: base weights untouched)."""
    return merged_named_weights(model)


def weight_buckets(named_params, bucket_bytes: int):
    """Group (name, tensor) pairs into lists of about `bucket_bytes` each (a ZeRO-3 partitioned
    parameter counts at its full size, `ds_numel`)."""
    bucket, size = [], 0
    for name, param in named_params:
        nbytes = param.ds_numel * param.element_size() if hasattr(param, "ds_numel") else param.nbytes
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, param))
        size += nbytes
    if bucket:
        yield bucket


def logprobs_mode_for(temperature: float) -> str:
    """vLLM's ``logprobs_mode`` that reports the temperature-scaled distribution before truncation.

    vLLM's "processed" log-probs come after temperature *and* the min-p / top-k / top-p cuts; its
    "raw" ones before both. At temperature 1 the raw ones are exactly the trainer's (the official
    SAGE code's choice); at another temperature only the processed ones are scaled, and they equal
    the trainer's when nothing is cut (`config.validate` refuses truncation with TIS there)."""
    return "raw_logprobs" if temperature == 1.0 else "processed_logprobs"


def sampling_options(params: SamplingParams, seed: int | None = None) -> dict:
    """vLLM ``SamplingParams`` keywords for ours, drawn with `seed`. top_k is passed only when set:
    vLLM's own default is "off" in every supported version (the value meaning off moved from -1
    to 0 across them)."""
    options = dict(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        min_p=params.min_p,
        max_tokens=params.max_new_tokens,
        stop=list(params.stop) or None,
        include_stop_str_in_output=True,
        logprobs=0 if params.logprobs else None,
        seed=seed,
    )
    if params.top_k:
        options["top_k"] = params.top_k
    return options


def to_vllm_sampling(vllm, params: SamplingParams, seed: int | None = None):
    """vLLM's SamplingParams for ours (`sampling_options`)."""
    return vllm.SamplingParams(**sampling_options(params, seed))


class VLLMEngine:
    """A colocated vLLM engine that samples from the training policy (see the module docstring).

    With sleep mode the engine holds no weights until the first `sync_weights`; a generate after
    a level-2 sleep re-pushes the last synced policy first, so repeated generations within one
    step (DAPO's dynamic sampling) stay correct. Without sleep mode (``sage-eval``) it keeps the
    checkpoint it loaded.

    temperature: the sampling temperature the trainer asks for; it picks which of vLLM's log-probs
    are returned (`logprobs_mode_for`).
    """

    def __init__(
        self,
        model_name_or_path: str,
        tokenizer,
        *,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = 4096,
        dtype: str = "bfloat16",
        seed: int = 0,
        enable_sleep_mode: bool = True,
        sync_bucket_mb: int = 512,
        tensor_parallel_size: int = 1,
        temperature: float = 1.0,
    ):
        vllm = _import_vllm()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the model in this process
        self.vllm = vllm
        self.tokenizer = tokenizer
        self.enable_sleep_mode = enable_sleep_mode
        self.sync_bucket_bytes = sync_bucket_mb << 20
        self.pushes = 0
        self.last_sync_s = 0.0
        self._push_s = 0.0  # pushing time since the last sync_weights returned
        self._policy = None
        self._awake_depth = 0
        self.llm = vllm.LLM(
            model=model_name_or_path,
            tokenizer=model_name_or_path,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            # vLLM's memory profiler is misled by its large default (as TRL notes); None keeps it
            max_num_batched_tokens=max_num_batched_tokens,
            enable_sleep_mode=enable_sleep_mode,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend=executor_backend(),
            logprobs_mode=logprobs_mode_for(temperature),
            trust_remote_code=False,  # a model folder is data: its own code never runs
        )
        self._weights_loaded, self._kv_asleep = True, False
        if enable_sleep_mode:  # the policy is pushed before any generation: keep no copy of the checkpoint
            self._sleep()

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[list[Completion]]:
        self._wake()
        seeds = prompt_seeds(params, len(prompts))
        keep = -params.max_prompt_tokens if params.max_prompt_tokens else 0  # left truncation
        requests = [
            {"prompt_token_ids": self.tokenizer(p, add_special_tokens=False)["input_ids"][keep:]} for p in prompts
        ]
        sampling = [to_vllm_sampling(self.vllm, params, seed) for seed in seeds]
        outputs = self.llm.generate(requests, sampling_params=sampling, use_tqdm=False)
        results = []
        for index, output in enumerate(outputs):
            results.append(
                [
                    Completion(
                        prompt_index=index,
                        prompt_ids=list(output.prompt_token_ids),
                        completion_ids=list(sample.token_ids),
                        text=sample.text,
                        logprobs=[lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids)]
                        if sample.logprobs is not None
                        else None,
                        finish_reason="length" if sample.finish_reason == "length" else "stop",
                    )
                    for sample in output.outputs
                ]
            )
        if not self._awake_depth:
            self._sleep()
        return results

    @contextlib.contextmanager
    def awake(self):
        """Keep weights and KV cache loaded across the generate calls inside (an evaluation);
        sleep on leaving if a generation woke the engine."""
        self._awake_depth += 1
        try:
            yield self
        finally:
            self._awake_depth -= 1
            if not self._awake_depth and not self._kv_asleep:
                self._sleep()

    def sync_weights(self, model) -> None:
        """Push `model`'s current weights (bucketed, ZeRO-3 gathered, LoRA merged) into vLLM."""
        self._policy = model
        self._push(model)
        self.last_sync_s, self._push_s = self._push_s, 0.0

    def _wake(self) -> None:
        if not self._weights_loaded:
            if self._policy is None:
                raise RuntimeError(
                    "the vllm engine holds no weights (sleep mode discards the checkpoint's at start-up): "
                    "call sync_weights(model) before generate"
                )
            self._push(self._policy)
        if self._kv_asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._kv_asleep = False

    def _sleep(self) -> None:
        """Level 2: weights and KV cache released (training gets the memory back; a push restores them)."""
        if self.enable_sleep_mode:
            self.llm.sleep(level=2)
            self._weights_loaded, self._kv_asleep = False, True

    def _load(self, weights: list) -> None:
        """Load (name, tensor) pairs into vLLM's model through its public `LLM.apply_model`: the
        model is in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so nothing is copied."""
        self.llm.apply_model(lambda vllm_model: vllm_model.load_weights(weights))

    def _push(self, model) -> None:
        torch.cuda.synchronize()  # time the push, not the work queued before it
        start = time.perf_counter()
        if not self._weights_loaded:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        params = list(model.parameters())
        if not any(hasattr(p, "ds_id") for p in params):
            for bucket in weight_buckets(policy_weights_for_vllm(model), self.sync_bucket_bytes):
                self._load(bucket)
        elif is_lora(model):  # ZeRO-3 + LoRA: merging needs each base weight and its factors at once
            with zero3_gathered(params):
                for bucket in weight_buckets(policy_weights_for_vllm(model), self.sync_bucket_bytes):
                    self._load(bucket)
        else:  # ZeRO-3: one gather per bucket
            for bucket in weight_buckets(model.named_parameters(), self.sync_bucket_bytes):
                with zero3_gathered([p for _, p in bucket]):
                    self._load([(name, p.data) for name, p in bucket])
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the previous weights
        torch.cuda.synchronize()
        self._push_s += time.perf_counter() - start
        self.pushes += 1
        self._weights_loaded = True
