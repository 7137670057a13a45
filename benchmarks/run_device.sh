#!/usr/bin/env bash
# One command for a lent CUDA machine (torch, triton, pytest and hypothesis preinstalled; no make,
# no network, no new torch), always done within 8 minutes: every part has its own timeout and a
# part cut short keeps what it wrote.
#
#   1. gpu.txt            the device, driver, torch, triton
#   2. triton_tests.log   the CUDA kernel tests, TRITON_INTERPRET unset (the fast-path tests first)
#   3. stages.md/.jsonl   benchmarks.profile_stages: each stage of both Triton paths at the Qwen2.5-7B
#                         head, N 16k, bf16, against the GEMM floor, with peak memory (profile.log)
#   4. loss.md/.jsonl/.png  sage-bench loss (python -m benchmarks.loss) at the Qwen2.5-7B head, N 16k,
#                         bf16, fwd+bwd, our provider first, then the floor and the peers (bench.log)
#
# Results go to $OUT when it is set (the device tool's folder), else benchmarks/results/device.
# Wheels in $WHEELS (default wheels/, e.g. liger-kernel) are installed offline when present; a
# missing peer is reported as skipped.
#
#   bash benchmarks/run_device.sh            # from anywhere; runs from the repository root
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/device}"
WHEELS="${WHEELS:-wheels}"
PY="${PYTHON:-python3}"
TOTAL_S=465          # the whole script, with a margin under 8 minutes
TESTS_S=170          # part 2 at most
PROFILE_S=100        # part 3 at most; part 4 gets the rest
mkdir -p "$OUT"
unset TRITON_INTERPRET  # tests/conftest.py sets it only where there is no CUDA device
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    # --target keeps the machine's own torch and triton untouched; --no-deps: they are there already.
    timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/sage-bench-site \
        "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/sage-bench-site"
fi

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
             "cuda", torch.version.cuda, torch.cuda.get_device_name())'; } 2>&1 | tee "$OUT/gpu.txt"

tests=$(ls tests/kernels/test_triton_fast_path.py tests/kernels/test_triton_*.py 2>/dev/null | awk '!seen[$0]++')
# shellcheck disable=SC2086
timeout "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -ra $tests 2>&1 | tee "$OUT/triton_tests.log"
tests_rc=${PIPESTATUS[0]}

timeout "$PROFILE_S" "$PY" -m benchmarks.profile_stages --device cuda --shape qwen2.5-7b --n 16384 --dtype bf16 \
    --repeats 3 --out "$OUT" 2>&1 | tee "$OUT/profile.log"
profile_rc=${PIPESTATUS[0]}

bench_s=$(( TOTAL_S - SECONDS ))
if (( bench_s > 90 )); then
    # --time-limit-s stops starting rows 60 s before the hard timeout, so the report is always written.
    timeout "$bench_s" "$PY" -m benchmarks.loss --device cuda --shapes qwen2.5-7b --n 16384 --masks 0 \
        --modes fwd+bwd --dtype bf16 --repeats 3 --budget-s 20 --time-limit-s $(( bench_s - 60 )) \
        --providers sage-triton,gemm-floor,liger-compiled,liger-eager,torch-compile-chunked,sage-triton-branch,naive \
        --out "$OUT" 2>&1 | tee "$OUT/bench.log"
    bench_rc=${PIPESTATUS[0]}
else
    echo "benchmark skipped: ${bench_s} s left" | tee "$OUT/bench.log"
    bench_rc=124
fi

echo "kernel tests: exit $tests_rc; stage profile: exit $profile_rc; benchmark: exit $bench_rc; ${SECONDS} s in all" \
    | tee "$OUT/summary.txt"
exit $(( tests_rc != 0 || profile_rc != 0 || bench_rc != 0 ))
