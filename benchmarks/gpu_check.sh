#!/usr/bin/env bash
# One GPU check for one H200, under 8 minutes, results under $OUT.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, on the GPU machine
#   bash benchmarks/gpu_check.sh --smoke    # CPU smoke of the same steps (tiny shapes), anywhere
#
# 1. installs the carried wheels in .whl/ (no package index there: torch, transformers, peft and
#    tensorboard are present; verl also needs pydantic, pydantic-core, annotated-types,
#    typing-inspection, rich, markdown-it-py, mdurl, pygments; download them here with
#    `pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl NAME==VERSION`);
# 2. `pytest -m gpu` (tests/gpu: sampler == generate on CUDA in fp32/bf16, bf16 training, FSDP2 over NCCL
#    with one rank, mixed precision, activation checkpointing, the collective guard on NCCL);
# 3. benchmarks/gpu_check.py: 10 GRPO steps of a random Qwen2.5-0.5B-shaped model in bf16 (64 prompts x 8
#    samples, 256 new tokens): rollout tokens/s ours vs HF generate, update MFU, peak memory, s/stage.
# Each part has its own time limit, so one that hangs cannot eat the others' time.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
SMOKE=0
if [[ "${1:-}" == "--smoke" ]]; then SMOKE=1; fi
start=$(date +%s)
log() { echo "[gpu_check +$(( $(date +%s) - start ))s] $*" | tee -a "$OUT/summary.txt"; }

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl > "$OUT/pip.txt" 2>&1 || { log "wheel install failed (see pip.txt)"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}

$PY - > "$OUT/env.txt" 2>&1 <<'PYEOF'
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("transformers", transformers.__version__)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
import verl  # the package imports here (its dependencies are installed)
print("verl ok")
PYEOF
rc_env=$?
log "environment rc=$rc_env: $(tr '\n' ' ' < "$OUT/env.txt" | cut -c1-300)"
[[ $rc_env -ne 0 ]] && exit 1

if [[ $SMOKE -eq 1 ]]; then
    timeout 120 $PY -m pytest -q -m gpu tests/gpu -rs -p no:cacheprovider > "$OUT/pytest_gpu.txt" 2>&1
    rc_test=$?
    timeout 300 $PY benchmarks/gpu_check.py --device cpu --small --out "$OUT" > "$OUT/bench.txt" 2>&1
    rc_bench=$?
else
    timeout 200 $PY -m pytest -q -m gpu tests/gpu -rs -p no:cacheprovider --junitxml "$OUT/pytest_gpu.xml" \
        > "$OUT/pytest_gpu.txt" 2>&1
    rc_test=$?
    timeout 240 $PY benchmarks/gpu_check.py --device cuda --out "$OUT" > "$OUT/bench.txt" 2>&1
    rc_bench=$?
fi
log "pytest -m gpu rc=$rc_test: $(tail -1 "$OUT/pytest_gpu.txt")"
log "benchmark rc=$rc_bench (124 = its time limit); table:"
tail -20 "$OUT/bench.txt" | tee -a "$OUT/summary.txt"
rm -rf "$OUT/model" "$OUT/grpo_run/checkpoints"  # weights do not need to come back
log "done in $(( $(date +%s) - start ))s"
[[ $rc_test -eq 0 && $rc_bench -eq 0 ]]
