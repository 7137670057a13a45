#!/usr/bin/env bash
# One run on a lent CUDA machine (torch, triton, pytest, pytest-timeout, pytest-xdist, hypothesis and
# matplotlib preinstalled; no make, no network, no new torch). A lease is 15 minutes of device time in
# all, its cold start (1-3 minutes) included: ONE run fits it, a second does not, so this one measures
# everything the package claims. Call it with the Liger-Kernel wheel carried (see benchmarks/README.md):
#
#   run(command="bash benchmarks/run_device.sh", timeout_s=600, carry=["wheels"])
#
# Seven parts, each under its own budget, in the order of what matters most: correctness on the device,
# then the 16k benchmark, then the stage profile. They add up to PLAN_S = 519 s; the script stops itself
# at RUN_S = 532 s (no part runs past it), so it ends within 9 minutes of wall time with its results
# packed, which leaves a cold start (1-3 minutes) and a retry's start inside the lease's 15 minutes. A
# trap packs what was written on TERM, INT or HUP and at exit, so an outer timeout loses nothing. Every
# part streams its output to run.log as it happens and keeps its rows when cut short.
#
#   1. environment     device, driver, torch, triton; wheels/*.whl installed offline                     20 s
#   2. kernel tests    the Triton test files, compiled for the GPU (TRITON_INTERPRET unset), the fast-path
#                      file first (its in-place barrier test at V 50257 and 50304): pytest -v, at most
#                      60 s a test (pytest-timeout), 4 processes (pytest-xdist), hypothesis profile
#                      "device" (3 examples a test: each may compile a kernel variant)                  130 s
#   3. variant tests   a second pytest call, same settings but 8 processes: gmpo, vespo, cispo, sapo,
#                      luspo, the off-policy mask, luspo's padding, and the softcap/logit-scale tests
#                      (their Triton cases: -k "not cpu")                                                50 s
#   4. packed tests    a third, 8 processes: packed sequences and DPPO on Triton (test_packed.py and
#                      test_dppo.py, -k triton)                                                          35 s
#   5. float64 parity  benchmarks.parity: three-matmul, two-pass and two-pass under a softcap, fwd+bwd on
#                      the whole point against float64, with verdicts against
#                      tests/kernels/tolerances.py, a process each, 28 s each                            84 s
#   6. benchmark       sage-bench loss, fwd+bwd, nothing masked, providers in $PROVIDERS order (ours and
#                      the floor first, Liger with TF32 on before Liger as PyTorch defaults it; each row
#                      records TF32 on/off), each in a worker of its own; a provider whose package is
#                      absent gets its skipped rows from the parent (no worker), and rows not started
#                      30 s before the end are reported as skipped                                      110 s
#   7. stage profile   benchmarks.profile_stages: three-matmul, gemm-floor, three-matmul-unsplit (d(hidden)
#                      as one product: what the vocabulary split gains), two-pass, a process each, 30 s
#                      each; the fourth runs in what the first three leave                               90 s
#
# The point is the Qwen2.5-7B head (D 3584, V 152064), N 16384, bf16. $OUT (the device tool's folder;
# default benchmarks/results/device) receives three files (the tool returns at most 8): run.log
# (everything, as it happens), summary.txt (each part's exit status, time and budget, then the verdicts
# of benchmarks.device_summary: the headline figures against their targets, each parity verdict, the
# kernel tests' outcomes per file; rewritten as each part ends) and results.tar.gz (gpu.txt,
# stages.md/.jsonl, parity.md/.jsonl, loss.md/.jsonl/.png, kernel-tests.log, variant-tests.log,
# packed-tests.log, repacked
# as each part ends). Exit status 0 when every part succeeded.
#
# For a check of this script's control flow elsewhere (tests/bench/test_run_device.py), the plan can be
# replaced through the environment: SAGE_DEVICE, SAGE_SHAPE, SAGE_N, SAGE_DTYPE, SAGE_REPEATS,
# SAGE_TESTS, SAGE_VARIANT_TESTS, SAGE_PACKED_TESTS (pytest arguments of the three calls, one a line),
# SAGE_PROVIDERS, and
# SAGE_BUDGET_SCALE (every budget and RUN_S multiplied by it; the CPU interpreter is slow).
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
# pytest arguments of the three calls, one a line
SOFTCAP_TESTS="tests/kernels/triton_backend/test_triton_loss.py::test_scaled_and_softcapped_logits
tests/kernels/triton_backend/test_triton_scoring.py::test_scaled_and_softcapped_logits"
TESTS="${SAGE_TESTS:-tests/kernels/triton_backend/test_triton_fast_path.py
tests/kernels/triton_backend/test_triton_loss.py
tests/kernels/triton_backend/test_triton_memory.py
tests/kernels/triton_backend/test_triton_ops.py
tests/kernels/triton_backend/test_triton_scoring.py
tests/kernels/triton_backend/test_triton_compile.py
$(printf -- '--deselect\n%s\n' $SOFTCAP_TESTS)}"
VARIANT_TESTS="${SAGE_VARIANT_TESTS:-$SOFTCAP_TESTS
tests/kernels/test_loss_variants.py
tests/kernels/test_off_policy_mask.py
tests/kernels/test_luspo_padding.py
-k
not cpu}"
PACKED_TESTS="${SAGE_PACKED_TESTS:-tests/kernels/test_packed.py
tests/kernels/test_dppo.py
-k
triton}"
# naive after Liger: at N 16k its [N, V] copies (~60 GB) leave it skipped on an 80 GB card, in a worker
PROVIDERS="${SAGE_PROVIDERS:-sage-triton,gemm-floor,liger-eager-tf32,liger-eager,liger-compiled,naive,sage-triton-branch,torch-compile-chunked}"
SCALE="${SAGE_BUDGET_SCALE:-1}"

ENV_S=20 TESTS_S=130 VARIANTS_S=50 PACKED_S=35 PARITY_PART_S=28 BENCH_S=110 PROFILE_PART_S=30
PARITY_PARTS=three-matmul,two-pass,two-pass-softcap
PROFILE_PARTS=three-matmul,gemm-floor,three-matmul-unsplit,two-pass
PARITY_S=$((3 * PARITY_PART_S)) PROFILE_S=$((3 * PROFILE_PART_S))
PLAN_S=$((ENV_S + TESTS_S + VARIANTS_S + PACKED_S + PARITY_S + BENCH_S + PROFILE_S))
PACK_S=13                      # the last pack and summary
RUN_S=$((PLAN_S + PACK_S))     # no part runs past it: 532 s, within 9 minutes
TEST_TIMEOUT_S=60              # one kernel test
scaled() { echo $(($1 * SCALE)); }

mkdir -p "$OUT"
rm -f "$OUT/run.log" "$OUT/summary.txt" "$OUT/results.tar.gz"
WORK=$(mktemp -d)
RESULTS="$WORK/results" SITE="$WORK/site"
mkdir -p "$RESULTS"
LOG="$OUT/run.log"
unset TRITON_INTERPRET  # tests/conftest.py and the benchmarks set it only where there is no CUDA device
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
if compgen -G "$WHEELS/*.whl" >/dev/null; then export PYTHONPATH="$PYTHONPATH:$SITE"; fi
export HYPOTHESIS_PROFILE=device PY WHEELS SITE RESULTS TEST_TIMEOUT_S TESTS VARIANT_TESTS PACKED_TESTS

summary=("plan: $PLAN_S s of part budgets, stopping by $RUN_S s (x$SCALE here); $DEVICE, $SHAPE, N $N, $DTYPE")
failed=0
PART_PID="" PART_NAME=""

# results.tar.gz from what the parts wrote so far, replaced in one rename
pack() { tar czf "$OUT/.results.tar.gz.part" -C "$RESULTS" . && mv -f "$OUT/.results.tar.gz.part" "$OUT/results.tar.gz"; }

write_summary() {
    {
        printf '%s\n' "${summary[@]}" "elapsed: $SECONDS s" "verdicts:"
        "$PY" -m benchmarks.device_summary "$RESULTS" 2>&1 | sed 's/^/  /'
    } >"$OUT/.summary.txt.part"
    mv -f "$OUT/.summary.txt.part" "$OUT/summary.txt"
}

# at exit, however it comes: stop a part still running, pack what is written before anything else
finish() {
    local rc=$?
    trap - EXIT TERM INT HUP
    if [ -n "$PART_PID" ]; then kill -TERM "$PART_PID" 2>/dev/null; fi  # timeout signals its group
    pack
    write_summary
    pack
    cat "$OUT/summary.txt"
    rm -rf "$WORK"
    exit "$rc"
}
cut_short() {
    summary+=("cut short by SIG$1 at $SECONDS s${PART_NAME:+, during $PART_NAME}")
    exit 143
}
trap finish EXIT
trap 'cut_short TERM' TERM
trap 'cut_short INT' INT
trap 'cut_short HUP' HUP

# part NAME BUDGET_S COMMAND...: run it under its budget (and before RUN_S), its output streamed to the
# log; record its status, rewrite the summary and repack. In the background, so that a signal's trap
# runs at once instead of after the part.
part() {
    local name=$1 budget left
    budget=$(scaled "$2")
    shift 2
    left=$(($(scaled "$RUN_S") - PACK_S - SECONDS))
    if [ "$left" -lt "$budget" ]; then budget=$left; fi
    if [ "$budget" -le 0 ]; then
        summary+=("$name: not started, $SECONDS s gone of $(scaled "$RUN_S") s")
        failed=1
        write_summary
        return
    fi
    local shown="$*"
    if [ "$1 $2" = "bash -c" ]; then shown="${3##*; }"; fi  # a function part: its call, not its source
    echo "== $name (at most $budget s): $shown" | tee -a "$LOG"
    local begin=$SECONDS
    timeout --kill-after=10 "$budget" "$@" >>"$LOG" 2>&1 &
    PART_PID=$! PART_NAME=$name
    wait "$PART_PID"
    local rc=$?
    PART_PID="" PART_NAME=""
    local line="$name: exit $rc, $((SECONDS - begin)) s (budget $budget s)"
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then line="$line, cut short at its budget"; fi
    local tests_log="$RESULTS/${name%% *}-tests.log"
    if [ -f "$tests_log" ]; then
        line="$line: $(grep -E '^=+ .*(passed|failed|error|skipped|deselected).* in [0-9.]+s' "$tests_log" | tail -1 | tr -d '=' | xargs)"
    fi
    summary+=("$line")
    [ "$rc" = 0 ] || failed=1
    write_summary
    pack
}

environment() {
    {
        if compgen -G "$WHEELS/*.whl" >/dev/null; then
            # --target keeps the machine's own torch and triton untouched; --no-deps: they are there already
            "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl || status=1
            for installed in "$SITE"/*.dist-info; do echo "from wheels: $(basename "$installed" .dist-info)"; done
        fi
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
        "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
                  "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")'
        "$PY" -c 'from importlib.metadata import version
for name in ("liger-kernel", "pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "matplotlib"):
    try:
        print(name, version(name))
    except Exception:  # not installed
        print(name, "absent")'
        exit "${status:-0}"  # this group runs in a subshell of its own (a pipeline's)
    } 2>&1 | tee "$RESULTS/gpu.txt"
    return "${PIPESTATUS[0]}"
}

# pytest_call NAME ARGS_VARIABLE WORKERS: pytest -v on the arguments the variable lists (one a line) in
# WORKERS processes, its output also kept as $RESULTS/NAME-tests.log
pytest_call() {
    local name=$1 args extra=()
    mapfile -t args <<<"${!2}"
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then extra+=(--timeout="$TEST_TIMEOUT_S"); fi
    if "$PY" -c "import xdist" 2>/dev/null; then extra+=(-n "$3"); fi
    "$PY" -m pytest -v --tb=short -p no:cacheprovider -o addopts="" -ra "${extra[@]}" "${args[@]}" 2>&1 |
        tee "$RESULTS/$name-tests.log"
    return "${PIPESTATUS[0]}"
}

# timeout runs programs, not shell functions: each function part runs in a bash of its own
part environment "$ENV_S" bash -c "$(declare -f environment); environment"
part "kernel tests" "$TESTS_S" bash -c "$(declare -f pytest_call); pytest_call kernel TESTS 4"
part "variant tests" "$VARIANTS_S" bash -c "$(declare -f pytest_call); pytest_call variant VARIANT_TESTS 8"
part "packed tests" "$PACKED_S" bash -c "$(declare -f pytest_call); pytest_call packed PACKED_TESTS 8"
POINT=(--device "$DEVICE" --shape "$SHAPE" --n "$N" --dtype "$DTYPE" --out "$RESULTS")
part "float64 parity" "$PARITY_S" "$PY" -m benchmarks.parity "${POINT[@]}" --paths "$PARITY_PARTS" \
    --part-timeout-s "$(scaled "$PARITY_PART_S")"
part benchmark "$BENCH_S" "$PY" -m benchmarks.loss --device "$DEVICE" --shapes "$SHAPE" --n "$N" --masks 0 \
    --modes fwd+bwd --dtype "$DTYPE" --repeats "$REPEATS" --budget-s "$(scaled 10)" \
    --time-limit-s "$(scaled $((BENCH_S - 30)))" --providers "$PROVIDERS" --out "$RESULTS"
part "stage profile" "$PROFILE_S" "$PY" -m benchmarks.profile_stages "${POINT[@]}" --repeats "$REPEATS" \
    --paths "$PROFILE_PARTS" --part-timeout-s "$(scaled "$PROFILE_PART_S")"
exit "$failed"
