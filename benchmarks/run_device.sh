#!/usr/bin/env bash
# One command for a lent CUDA machine (torch, triton, pytest, pytest-timeout, pytest-xdist preinstalled;
# no make, no network, no new torch). Five parts, each under its own time budget; the budgets add up to
# PLAN_S (410 s), so a second run fits a 15-minute lease. Every part streams its output to one log as it
# happens, writes its results as each of its pieces ends, and keeps them when it is cut short:
#
#   1. environment       the device, driver, torch, triton; liger-kernel from $WHEELS if carried     20 s
#   2. kernel tests      the Triton tests compiled for the GPU (TRITON_INTERPRET unset), the fast-path
#                        file first: pytest -v --tb=short, at most 60 s a test where pytest-timeout
#                        is installed, four processes where pytest-xdist is                         130 s
#   3. stage profile     benchmarks.profile_stages: each path and the GEMM floor in a process of its
#                        own, at most 25 s each                                                      80 s
#   4. float64 parity    benchmarks.parity: each path fwd+bwd on the whole point against a chunked
#                        float64 evaluation (the loss, sampled weight and hidden rows), 25 s each    55 s
#   5. benchmark         sage-bench loss, fwd+bwd, nothing masked, providers in $PROVIDERS order, each
#                        in a worker process of its own; rows not started 25 s before the end are
#                        reported as skipped                                                        125 s
#
# The point is the Qwen2.5-7B head (D 3584, V 152064), N 16384, bf16. $OUT (the device tool's folder;
# default benchmarks/results/device) receives three files: run.log (everything, as it happens),
# summary.txt (each part's exit status, time and budget, rewritten as each part ends) and
# results.tar.gz (stages.md/.jsonl, parity.md/.jsonl, loss.md/.jsonl/.png, gpu.txt, repacked as each
# part ends). Exit status 0 when every part succeeded.
#
#   bash benchmarks/run_device.sh            # from anywhere; runs from the repository root
#
# For a check of this script's control flow elsewhere (tests/bench/test_run_device.py), the plan can be
# replaced through the environment: SAGE_DEVICE, SAGE_SHAPE, SAGE_N, SAGE_DTYPE, SAGE_REPEATS,
# SAGE_TESTS, SAGE_PROVIDERS, and SAGE_BUDGET_SCALE (every budget multiplied by it; the CPU interpreter
# is slow).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/device}"
WHEELS="${WHEELS:-wheels}"
PY="${PYTHON:-python3}"
DEVICE="${SAGE_DEVICE:-cuda}"
SHAPE="${SAGE_SHAPE:-qwen2.5-7b}"
N="${SAGE_N:-16384}"
DTYPE="${SAGE_DTYPE:-bf16}"
REPEATS="${SAGE_REPEATS:-3}"
TESTS="${SAGE_TESTS:-tests/kernels/test_triton_fast_path.py tests/kernels/test_triton_loss.py tests/kernels/test_triton_memory.py tests/kernels/test_triton_ops.py tests/kernels/test_triton_scoring.py tests/kernels/test_triton_compile.py}"
PROVIDERS="${SAGE_PROVIDERS:-sage-triton,gemm-floor,naive,sage-triton-branch,liger-compiled,liger-eager,torch-compile-chunked}"
SCALE="${SAGE_BUDGET_SCALE:-1}"

ENV_S=20 TESTS_S=130 PROFILE_S=80 PARITY_S=55 BENCH_S=125
PART_S=25         # one profile or parity part (one process)
TEST_TIMEOUT_S=60 # one kernel test
PLAN_S=$((ENV_S + TESTS_S + PROFILE_S + PARITY_S + BENCH_S))
scaled() { echo $(($1 * SCALE)); }

mkdir -p "$OUT"
rm -f "$OUT/run.log" "$OUT/summary.txt" "$OUT/results.tar.gz"
RESULTS=$(mktemp -d)
LOG="$OUT/run.log"
unset TRITON_INTERPRET  # tests/conftest.py and the benchmarks set it only where there is no CUDA device
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1

summary=("plan: $PLAN_S s of part budgets (limit 420 s), x$SCALE here; $DEVICE, $SHAPE, N $N, $DTYPE")
failed=0
# part NAME BUDGET_S COMMAND...: run it under its budget, its output streamed to the log, then record
# its status and repack the results
part() {
    local name=$1 budget
    budget=$(scaled "$2")
    shift 2
    echo "== $name (at most $budget s): $*" | tee -a "$LOG"
    local begin=$SECONDS
    timeout --kill-after=10 "$budget" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local line="$name: exit $rc, $((SECONDS - begin)) s (budget $budget s)"
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then line="$line, cut short at its budget"; fi
    if [ "$name" = "kernel tests" ]; then
        line="$line: $(grep -E '^=+ .*(passed|failed|error).* in [0-9.]+s' "$LOG" | tail -1 | tr -d '=' | xargs)"
    fi
    summary+=("$line")
    [ "$rc" = 0 ] || failed=1
    printf '%s\n' "${summary[@]}" "total: $SECONDS s" >"$OUT/summary.txt"
    tar czf "$OUT/results.tar.gz" -C "$RESULTS" .
}

environment() {
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        # --target keeps the machine's own torch and triton untouched; --no-deps: they are there already
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/sage-bench-site "$WHEELS"/*.whl
    fi
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
      "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
                 "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")'
    } | tee "$RESULTS/gpu.txt"
}

kernel_tests() {
    local extra=()
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then extra+=(--timeout="$TEST_TIMEOUT_S"); fi
    if "$PY" -c "import xdist" 2>/dev/null; then extra+=(-n 4); fi
    # shellcheck disable=SC2086  # TESTS is a list of paths
    "$PY" -m pytest -v --tb=short -p no:cacheprovider -o addopts="" -ra "${extra[@]}" $TESTS
}

if compgen -G "$WHEELS/*.whl" >/dev/null; then export PYTHONPATH="$PYTHONPATH:/tmp/sage-bench-site"; fi
export PY WHEELS RESULTS TESTS TEST_TIMEOUT_S
# timeout runs programs, not shell functions: each function part runs in a bash of its own
part environment "$ENV_S" bash -c "$(declare -f environment); environment"
part "kernel tests" "$TESTS_S" bash -c "$(declare -f kernel_tests); kernel_tests"
POINT=(--device "$DEVICE" --shape "$SHAPE" --n "$N" --dtype "$DTYPE" --out "$RESULTS")
part "stage profile" "$PROFILE_S" "$PY" -m benchmarks.profile_stages "${POINT[@]}" --repeats "$REPEATS" \
    --part-timeout-s "$(scaled "$PART_S")"
part "float64 parity" "$PARITY_S" "$PY" -m benchmarks.parity "${POINT[@]}" --part-timeout-s "$(scaled "$PART_S")"
part benchmark "$BENCH_S" "$PY" -m benchmarks.loss --device "$DEVICE" --shapes "$SHAPE" --n "$N" --masks 0 \
    --modes fwd+bwd --dtype "$DTYPE" --repeats "$REPEATS" --budget-s "$(scaled 10)" \
    --time-limit-s "$(scaled $((BENCH_S - 25)))" --providers "$PROVIDERS" --out "$RESULTS"
rm -rf "$RESULTS"
exit "$failed"
