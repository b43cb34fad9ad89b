#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.sh installs on a lent GPU machine, which has no package index: its image has
# Python 3.12, torch (CUDA), transformers, peft and tensorboard, but not what else verl imports. Run this here
# (where pip reaches an index), then carry .whl/ with the checkout; gpu_check.sh installs it first.
#
#   bash benchmarks/gpu_wheels.sh         # -> .whl/*.whl, their total checked against the 64 MiB carry limit
#
# The versions are this environment's (what the CPU suite ran against), so the GPU check tests the same code
# paths; a package missing here is taken at its newest. manylinux x86_64 wheels for CPython 3.12 only.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.whl}
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=python3
LIMIT=$((64 * 1024 * 1024))
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection rich markdown-it-py mdurl pygments)

specs=()
for name in "${PACKAGES[@]}"; do
    version=$("$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$name")
    specs+=("$name${version:+==$version}")
done
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$DEST" "${specs[@]}"
total=$(cat "$DEST"/*.whl | wc -c)
ls -1 "$DEST"/*.whl
echo "${#specs[@]} wheels, $((total / 1024)) KiB in $DEST (carry limit $((LIMIT / 1024 / 1024)) MiB)"
if (( total > LIMIT )); then
    echo "error: $DEST is over the 64 MiB a device run can carry; drop what the GPU image already has" >&2
    exit 1
fi
