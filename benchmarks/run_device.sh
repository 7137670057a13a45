#!/usr/bin/env bash
# On a CUDA machine: the Triton kernel tests without the interpreter, then the loss benchmark's
# CUDA plan (shapes.DEFAULT_PLANS["cuda"]: Qwen2.5-7B and Llama-3-8B heads, bf16, N up to 32k),
# all in under 8 minutes. Needs no package registry: wheels in $WHEELS (default wheels/, e.g. a
# liger-kernel wheel) are installed offline when present; a missing peer is reported as skipped.
# Results go to $OUT when it is set (the device tool's folder), else benchmarks/results/device:
# gpu.txt, triton_tests.log, bench.log, loss.jsonl, loss.md, loss.png.
#
#   bash benchmarks/run_device.sh            # from anywhere; runs from the repository root
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/device}"
WHEELS="${WHEELS:-wheels}"
PY="${PYTHON:-python3}"
TOTAL_S=470          # the whole script, with a margin under 8 minutes
TESTS_S=180          # the kernel tests at most; the benchmark gets the rest
mkdir -p "$OUT"
unset TRITON_INTERPRET  # tests/conftest.py sets it only where there is no CUDA device
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    # --target keeps the machine's own torch and triton untouched; --no-deps: they are there already.
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/sage-bench-site "$WHEELS"/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/sage-bench-site"
fi

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
             "cuda", torch.version.cuda, torch.cuda.get_device_name())'; } 2>&1 | tee "$OUT/gpu.txt"

timeout "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_*.py 2>&1 | tee "$OUT/triton_tests.log"
tests_rc=${PIPESTATUS[0]}

bench_s=$(( TOTAL_S - SECONDS ))
# --time-limit-s stops starting rows 60 s before the hard timeout, so the report is always written.
timeout "$bench_s" "$PY" -m benchmarks.loss --device cuda --out "$OUT" --time-limit-s $(( bench_s - 60 )) \
    2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "kernel tests: exit $tests_rc; benchmark: exit $bench_rc; ${SECONDS} s in all"
exit $(( tests_rc != 0 || bench_rc != 0 ))
