#!/usr/bin/env bash
# One GPU check for one H200, under 8 minutes, results under $OUT.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, on the GPU machine
#   bash benchmarks/gpu_check.sh --smoke    # CPU smoke of the same steps (tiny shapes), anywhere
#
# 1. installs the carried wheels in .whl/ (no package index there: torch, transformers, peft and
#    tensorboard are present; verl also needs pydantic, pydantic-core, annotated-types,
#    typing-inspection, rich, markdown-it-py, mdurl, pygments; `bash benchmarks/gpu_wheels.sh` downloads them
#    into .whl/ where pip reaches an index, at this environment's versions, and checks the 64 MiB carry limit);
# 2. `pytest -m gpu tests/gpu`: sampler == generate on CUDA in fp32/bf16; bf16 training; FSDP2 over NCCL
#    with one rank, mixed precision, activation checkpointing; weights that move at lr 1e-6 in the default
#    precision (and not with bf16 masters); CPU offload; the collective guard on NCCL; GRPO with a KL loss
#    split over 2 GPUs, colocated vLLM on 2 ranks and asynchronous RL with vLLM on a rollout rank of its own
#    (2 GPUs) (each skips itself where it cannot run: 1 GPU, no vllm);
# 3. benchmarks/gpu_check.py: GRPO steps of a random Qwen2.5-0.5B-shaped model in bf16 (64 prompts x 8
#    samples, 256 new tokens): rollout tokens/s ours vs HF generate, update MFU, peak memory, s/stage;
# 4. one table of every part and its status (benchmarks/gpu_check_table.py), also in $OUT/summary.txt.
# Each part has its own time limit, so one that hangs cannot eat the others' time; together they stay
# under 8 minutes (tests/test_gpu_check_script.py checks the sum).
set -uo pipefail

T_WHEELS=40 T_ENV=30 T_TESTS=230 T_BENCH=170  # seconds; sum 470 < 480
BENCH_STEPS=6  # GRPO steps of the benchmark on the GPU (enough for the averages; fits T_BENCH)

cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
rm -f "$OUT/pytest_gpu.xml" "$OUT/pytest_gpu.txt" "$OUT/gpu_check.json" "$OUT/summary.txt"  # no stale results
SMOKE=0
if [[ "${1:-}" == "--smoke" ]]; then
    SMOKE=1
    (( T_ENV *= 6 ))  # on a busy CPU machine importing torch and transformers alone can take half a minute
fi
start=$(date +%s)
log() { echo "[gpu_check +$(( $(date +%s) - start ))s] $*" | tee -a "$OUT/summary.txt"; }
PY=${PYTHON:-python3}
rc_wheels="" rc_env="" rc_test="" rc_bench=""

finish() {  # the one table, then the exit status: 0 only when every part that ran passed
    rm -rf "$OUT/model" "$OUT/grpo_run/checkpoints"  # weights do not need to come back
    log "done in $(( $(date +%s) - start ))s"
    $PY benchmarks/gpu_check_table.py --out "$OUT" --rc "wheels=$rc_wheels" --rc "env=$rc_env" \
        --rc "pytest=$rc_test" --rc "bench=$rc_bench" --elapsed "$(( $(date +%s) - start ))" \
        | tee -a "$OUT/summary.txt"
    [[ "${rc_wheels:-0}" -eq 0 && "$rc_env" == 0 && "$rc_test" == 0 && "$rc_bench" == 0 ]]
    exit $?
}

if compgen -G ".whl/*.whl" > /dev/null; then
    timeout $T_WHEELS python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl > "$OUT/pip.txt" 2>&1
    rc_wheels=$?
    [[ $rc_wheels -ne 0 ]] && { log "wheel install failed rc=$rc_wheels (see pip.txt)"; finish; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

timeout $T_ENV $PY - > "$OUT/env.txt" 2>&1 <<'PYEOF'
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("transformers", transformers.__version__)
if torch.cuda.is_available():
    print("device", torch.cuda.device_count(), "x", torch.cuda.get_device_name(0),
          f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
import verl  # the package imports here (its dependencies are installed)
print("verl ok")
PYEOF
rc_env=$?
log "environment rc=$rc_env: $(tr '\n' ' ' < "$OUT/env.txt" | cut -c1-300)"
[[ $rc_env -ne 0 ]] && finish

# -v, unbuffered: a run cut off by its limit still says which tests finished and which one was running
PYTHONUNBUFFERED=1 timeout $T_TESTS $PY -m pytest -v -m gpu tests/gpu -rs -p no:cacheprovider \
    --junitxml "$OUT/pytest_gpu.xml" > "$OUT/pytest_gpu.txt" 2>&1
rc_test=$?
log "pytest -m gpu rc=$rc_test: $(tail -1 "$OUT/pytest_gpu.txt")"
if [[ $SMOKE -eq 1 ]]; then
    timeout 300 $PY benchmarks/gpu_check.py --device cpu --small --out "$OUT" > "$OUT/bench.txt" 2>&1
else
    timeout $T_BENCH $PY benchmarks/gpu_check.py --device cuda --steps $BENCH_STEPS --out "$OUT" \
        > "$OUT/bench.txt" 2>&1
fi
rc_bench=$?
log "benchmark rc=$rc_bench (124 = its time limit); its own table:"
tail -20 "$OUT/bench.txt" | tee -a "$OUT/summary.txt"
finish
