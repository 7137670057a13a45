#!/usr/bin/env bash
# README's "Installing with pip" as a user pastes it (issue 47), so the README cannot drift from what works:
#  1. a copy of the checkout (its tracked and untracked, not ignored, files: no .venv, build/ or dist/);
#  2. in a fresh venv there, the lines between <!-- pip-route --> and <!-- /pip-route -->, as written;
#  3. from outside the copy (so the installed package is imported, not the source tree): the README's two
#     loss examples, then `sage-train --steps 2`;
#  4. `pip check` with [train,trl], then [train,bench], then [dev] installed;
#  5. in a second fresh venv, the lines between <!-- pip-route-wheel --> and <!-- /pip-route-wheel -->, and
#     the loss example again on the wheel's package.
# PIP_ROUTE_DIR keeps the work folder (default: a temporary one, removed at the end).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
readme="$root/README.md"
work=${PIP_ROUTE_DIR:-$(mktemp -d)}
[[ -n ${PIP_ROUTE_DIR:-} ]] || trap 'rm -rf "$work"' EXIT
mkdir -p "$work"

# The shell lines of README's block between <!-- NAME --> and <!-- /NAME --> (the code fences dropped).
block() {
    local lines
    lines=$(awk -v first="<!-- $1 -->" -v last="<!-- /$1 -->" '
        $0 == first { inside = 1; next }
        $0 == last { inside = 0 }
        inside && !/^```/ { print }' "$readme")
    if [[ -z $lines ]]; then
        echo "pip_route: README.md has no <!-- $1 --> block" >&2
        exit 1
    fi
    printf '%s\n' "$lines"
}

# The README's ```python blocks, one file each: the padded and the packed loss examples.
python_blocks() {
    awk -v dir="$1" '
        /^```python$/ { n += 1; file = dir "/readme_example_" n ".py"; inside = 1; next }
        /^```$/ { inside = 0 }
        inside { print > file }' "$readme"
}

# Run README block $2 in the fresh venv $1, from the checkout copy, each line echoed as it runs.
run_block() {
    local venv=$1 name=$2 lines
    lines=$(block "$name")
    echo "== pip_route: README block $name, in $venv"
    python3 -m venv "$venv"
    (
        cd "$work/checkout"
        # shellcheck disable=SC1091
        source "$venv/bin/activate"
        bash -euxo pipefail -c "$lines"
    )
}

start=$SECONDS
rm -rf "$work/checkout" "$work/venv" "$work/venv-wheel" "$work/outside"
mkdir -p "$work/checkout" "$work/outside"
(cd "$root" && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$work/checkout"
python_blocks "$work/outside"
examples=("$work"/outside/readme_example_*.py)
if [[ ${#examples[@]} -ne 2 ]]; then
    echo "pip_route: expected the README's 2 python examples, found ${#examples[@]}" >&2
    exit 1
fi

run_block "$work/venv" pip-route
cd "$work/outside"
"$work/venv/bin/python" -c "import sage_kernels, sys; sys.exit('site-packages' not in sage_kernels.__file__)" || {
    echo "pip_route: sage_kernels is not imported from the venv's site-packages" >&2
    exit 1
}
for example in "${examples[@]}"; do
    echo "== pip_route: $(basename "$example") (README's loss examples, on the installed package)"
    "$work/venv/bin/python" "$example"
done
echo "== pip_route: sage-train --steps 2"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$work/venv/bin/sage-train" --steps 2  # writes runs/ here, outside

for extras in train,trl train,bench dev; do
    echo "== pip_route: pip check with [$extras]"
    (cd "$work/checkout" && "$work/venv/bin/pip" install -q --no-build-isolation ".[$extras]")
    "$work/venv/bin/pip" check
done

run_block "$work/venv-wheel" pip-route-wheel
echo "== pip_route: $(basename "${examples[0]}") on the wheel's package"
"$work/venv-wheel/bin/python" "${examples[0]}"
echo "pip_route: the README's pip lines ran as pasted ($((SECONDS - start)) s)"
