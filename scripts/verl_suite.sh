#!/usr/bin/env bash
# The tests that run verl's own code (docs/integrations.md, verl), in verl's side environment:
# verl 0.9.1 pins transformers < 5.11 and needs ray, so it cannot share the project's .venv.
#
#   scripts/verl_suite.sh [pytest args]      (or `make verl-suite`)
#
# VERL_VENV (default .venv-verl, git-ignored) is built once and reused while the pins below are
# unchanged (its stamp holds them). SAGE_REQUIRE_VERL=1 turns a verl that does not import into a
# failure, where `make test` skips those tests.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VERL_VENV:-.venv-verl}"
TORCH="${TORCH:-torch==2.13.0}"
PINS="verl==0.9.1 $TORCH pytest>=8 hypothesis>=6.100 pytest-timeout>=2.3"
STAMP="$VENV/.installed"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$PINS" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
    # torch first (a CPU build on this project's machines), so that verl's dependencies resolve against it
    "$VENV/bin/python" -m pip install -q "$TORCH"
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m pip install -q $PINS
    # sage with its core dependencies only (no extras), beside verl's transformers
    "$VENV/bin/python" -m pip install -q --no-build-isolation -e .
    "$VENV/bin/python" -m pip check
    echo "$PINS" > "$STAMP"
fi

export SAGE_REQUIRE_VERL=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/kernels/integrations/test_verl.py \
    tests/kernels/integrations/test_verl_ray.py \
    tests/kernels/test_rollout_corr.py "$@"
