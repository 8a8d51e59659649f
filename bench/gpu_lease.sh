#!/usr/bin/env bash
# bench/gpu.sh's steps in ONE device call, for a lease too short for a call a step (15 minutes of device time, the
# machine's start included), each step under a time limit of its own: a slow one costs only its share, and what
# the others measured still comes back. The measurements first, then as much of the GPU tests as time leaves (a
# first lease ran 191 of their 640 tests in 180 s, Triton compiling and autotuning, none failing):
#
#     LLMRUN_COMMIT=$(git rev-parse --short HEAD) RESULTS=/tmp/r bash bench/gpu_lease.sh; tar czf $OUT/r.tgz -C /tmp/r .
#
# carrying .whl and .gpu-model/tokenizer.gguf (bench/gpu_prepare.sh writes both).
#   speed   llama3.2-1b at a 128-token prompt, bf16 then W4A16, `--compare`; then bf16 without CUDA graphs
#   kv      llama3.1-8b at 8k and 32k positions, bf16 / int8 / int4 KV, one timed run each
#   replay  the Qwen pair's replayed acceptance, 4-bit weights, the first 4 HumanEval prompts (its step times also
#           feed `bench/replay.py simulate` here, for all of them)
#   memory  the longest context each KV format holds beside the 8B's weights
#   tests   the GPU test files, spread over 12 pytest-xdist workers (Triton compiles and autotunes on the CPUs)
# The embedded model is left out: its file travels in two calls. The steps' limits total 495 s: give the call 540.
set -uo pipefail
cd "$(dirname "$0")/.."
export RESULTS=${RESULTS:-bench/results}
mkdir -p "$RESULTS"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv \
    | tee "$RESULTS/nvidia-smi.csv"

step() {  # step SECONDS GPU_STEPS [SHAPE...]: gpu.sh for those steps, stopped after SECONDS
    local limit=$1 steps=$2 start=$SECONDS code=0
    shift 2
    echo "gpu_lease: $steps (at most $limit s)" >&2
    GPU_STEPS=$steps timeout -k 10 "$limit" bash bench/gpu.sh "$@" || code=$?
    echo "gpu_lease: $steps took $((SECONDS - start)) s, exit $code$([ $code = 124 ] && echo ' (its time limit)')" \
        | tee -a "$RESULTS/lease.log" >&2
}

GPU_PROMPTS=128 step 140 speed llama3.2-1b
GPU_KV_REPEAT=1 step 140 kv
GPU_REPLAY_WEIGHTS=int4 GPU_REPLAY_PROMPTS=4 step 60 replay
step 15 memory
PYTEST_ADDOPTS="-n 12" step 140 tests
# a run cut off by its step's limit leaves its JSON empty or half-written
find "$RESULTS" -name '*.json' -size 0 -delete
cat "$RESULTS/lease.log" >&2
