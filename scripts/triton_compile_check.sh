#!/usr/bin/env bash
# The sm_90 compile test (tests/kernels/triton_backend/test_triton_compile.py --all: every kernel compiled down to a
# cubin for the H200 at the GPU tile shapes, every sweep variant (dtype x bias x softcap x entropy
# gradient) within its spill bound, a table of spill bytes) under several Triton versions, on a machine
# without a GPU. A version other than "installed" runs in a side
# virtual environment, $SAGE_CACHE/triton-<version> (default ~/.cache/sage), made on first use with
# `pip install triton==<version>.*` and seeing the project's environment (torch, sage) after its own
# site-packages, so its Triton is the one imported. Nothing is written to the repository.
#
#   scripts/triton_compile_check.sh              # the installed Triton and 3.6 (the lent H200's)
#   scripts/triton_compile_check.sh 3.6 3.7      # those versions only
#
# Slow (a minute per version on two cores, plus the first install): not part of `make test`, whose run
# of the test compiles the bf16 variants and the unbiased fp16 and fp32 ones under the installed Triton.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
CACHE=${SAGE_CACHE:-$HOME/.cache/sage}
if [ "$#" -gt 0 ]; then versions=("$@"); else versions=(installed 3.6); fi
purelib() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
project_site=$(purelib "$PYTHON")

status=0
for version in "${versions[@]}"; do
    if [ "$version" = installed ]; then
        python=$PYTHON
    else
        side="$CACHE/triton-$version"
        if ! "$side/bin/python" -c "import triton" >/dev/null 2>&1; then
            echo "== making $side (pip install triton==$version.*)"
            "$PYTHON" -m venv "$side"
            "$side/bin/pip" install -q "triton==$version.*"
        fi
        echo "import site; site.addsitedir('$project_site')" >"$(purelib "$side/bin/python")/zz_sage_project.pth"
        python="$side/bin/python"
    fi
    echo "== $version: $("$python" -c 'import triton; print("triton", triton.__version__)')"
    cache=$(mktemp -d)  # a fresh cache: ptxas runs and reports its spills
    if ! env -u TRITON_INTERPRET TRITON_CACHE_DIR="$cache" TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH="$PWD" \
        "$python" tests/kernels/triton_backend/test_triton_compile.py --all; then
        echo "== $version: FAILED"
        status=1
    fi
    rm -rf "$cache"
done
exit "$status"
