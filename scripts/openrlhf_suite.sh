#!/usr/bin/env bash
# OpenRLHF 0.11.2's side environment and the tests that run its own code (docs/integrations.md, OpenRLHF):
# its PolicyLoss and compute_approx_kl against the adapter, and the launcher reaching a local Ray actor.
# OpenRLHF's wheel pins flash-attn, deepspeed, vllm and CUDA builds that do not install beside this project
# on CPU, so it goes in with --no-deps, followed by what its models package imports (deepspeed, peft,
# transformers at OpenRLHF's pin, einops), what its experience functions import, and Ray. flash-attn has no
# CPU build: tests/openrlhf_cpu/ holds a stand-in for the two flash-attn modules that openrlhf.models
# imports (import only; every function raises).
# SAGE_OPENRLHF_VENV: where the venv goes (default ~/.cache/sage-openrlhf-suite/venv); TORCH: the torch pin.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${SAGE_OPENRLHF_VENV:-$HOME/.cache/sage-openrlhf-suite/venv}
TORCH=${TORCH:-torch==2.13.0}
PY=$VENV/bin/python
STAMP=$VENV/.installed-openrlhf-0.11.2
if [ ! -f "$STAMP" ]; then
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip setuptools wheel
    "$PY" -m pip install -q "$TORCH"
    "$PY" -m pip install -q --no-deps openrlhf==0.11.2
    # deepspeed builds against the installed torch (no ops compiled ahead: DS_BUILD_OPS defaults to 0)
    "$PY" -m pip install -q --no-build-isolation "deepspeed==0.19.6"
    # openrlhf.models: transformers (OpenRLHF's pin), peft, einops; its experience functions (openrlhf.utils):
    # pylatexenc, sympy; then Ray, this project's own needs (numpy, ninja) and its test tools
    "$PY" -m pip install -q "transformers==5.15.0" peft einops pylatexenc sympy "ray==2.55.0" numpy ninja \
        "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
    touch "$STAMP"
fi
cd "$ROOT"
# the repository's packages from the checkout (Ray's workers inherit PYTHONPATH from the driver)
export PYTHONPATH="$ROOT:$ROOT/tests/openrlhf_cpu${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m pytest -q -p no:cacheprovider tests/kernels/integrations/test_openrlhf.py \
    tests/kernels/integrations/test_openrlhf_launch.py "$@"
