#!/usr/bin/env bash
# GPU smoke test of the vllm rollout engine. First the engine's own GPU test
# (tests/train/rollout/test_vllm_engine.py: level-2 sleep from start-up, pushes counted, an awake
# session pushing nothing, seeded and per-prompt-seeded sampling, log-probs against the
# trainer's with min_p on). Then a few RL steps of `sage-train` with the colocated vLLM engine
# (sleep mode, weight sync after every optimizer step, token-level truncated importance sampling
# with min_p 0.01 as in the recipes), on a small Qwen2-style model built from config (the trainer
# saves it to runs/<name>/rollout_init first, so vLLM can load it). Three runs: full weights,
# LoRA, and LoRA under ZeRO-3 (the whole model gathered for each push).
#
#   scripts/gpu_smoke.sh            # logs under $OUT when set, else a temporary directory
#
# Exits 0 with "skipped: no vllm/GPU" where vLLM or a CUDA GPU is missing, so it can run anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then  # the repository's virtual environment when there is one
    PYTHON=python
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
fi

if ! "$PYTHON" -c "import torch, vllm; assert torch.cuda.is_available()" >/dev/null 2>&1; then
    echo "gpu_smoke: skipped: no vllm/GPU (needs 'import vllm' to work and a CUDA device)"
    exit 0
fi

LOG_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/gpu_smoke.log"
echo "gpu_smoke: logging to $LOG"
{
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
    "$PYTHON" -c "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"
} >"$LOG" 2>&1

status=0
echo "== test_vllm_engine" | tee -a "$LOG"
if ! timeout 600 "$PYTHON" -m pytest -q -p no:cacheprovider tests/train/rollout/test_vllm_engine.py >>"$LOG" 2>&1; then
    echo "gpu_smoke: test_vllm_engine FAILED (see $LOG)" | tee -a "$LOG"
    status=1
fi

COMMON=(
    --config tiny-cpu --output_dir "$LOG_DIR/runs" --progress=false --plots=false --tensorboard=false
    --rollout_engine=vllm --vllm_gpu_memory_utilization=0.2 --vllm_max_model_len=0
    --tiny_hidden_size=256 --tiny_heads=4 --tiny_kv_heads=2 --tiny_intermediate_size=512
    --sft_steps=300 --sft_target_loss=0 --steps=4 --save_every=4 --eval_problems=16 --eval_samples=4
    --tis_level=token --tis_cap=2.0 --temperature=1.0 --min_p=0.01
)
for run in "full --lora_rank=0 --lr=3e-4" "lora --lora_rank=8 --lr=3e-3" \
    "zero3-lora --lora_rank=8 --lr=3e-3 --zero_stage=3 --deepspeed_config=ds-zero3"; do
    set -- $run
    name="gpu-smoke-$1"
    shift
    echo "== $name" | tee -a "$LOG"
    if ! timeout 900 "$PYTHON" -m sage_train "${COMMON[@]}" --name="$name" "$@" >>"$LOG" 2>&1; then
        echo "gpu_smoke: $name FAILED (see $LOG)" | tee -a "$LOG"
        status=1
        continue
    fi
    if ! "$PYTHON" - "$LOG_DIR/runs/$name/metrics.jsonl" <<'PY' | tee -a "$LOG"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert [r["step"] for r in rows] == [1, 2, 3, 4], rows
for r in rows:
    print(f"step {r['step']}: reward {r['reward']:.3f} sync {r['rollout/sync_time']:.3f}s "
          f"tis/weight_mean {r['tis/weight_mean']:.4f} tis/abs_log_ratio {r['tis/abs_log_ratio']:.4f}")
    assert r["rollout/sync_time"] > 0, r
    # log-probs before the min_p cut on both sides: the weights are ~1 (bf16 noise), not the kept mass
    assert abs(r["tis/weight_mean"] - 1) < 0.1, r
PY
    then
        echo "gpu_smoke: $name metrics check FAILED" | tee -a "$LOG"
        status=1
    fi
done
[ "$status" = 0 ] && echo "gpu_smoke: ok" | tee -a "$LOG"
exit "$status"
