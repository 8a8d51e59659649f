#!/usr/bin/env bash
# bench/gpu.sh's steps in ONE device call, for a lease too short for a call a step (15 minutes of device time, the
# machine's start included), each step under a time limit of its own: a slow one costs only its share, and what
# the others measured still comes back. GPU_RESUME=1: each lease goes on where the committed results of the same
# GPU model stop (bench/results/: a run whose JSON is there, a test its logs record as passed, is left out):
#
#     LLMRUN_COMMIT=$(git rev-parse --short HEAD) RESULTS=/tmp/r bash bench/gpu_lease.sh; tar czf $OUT/r.tgz -C /tmp/r .
#
# carrying .whl and .gpu-model/tokenizer.gguf (bench/gpu_prepare.sh writes both); then commit what came back.
#   speed   llama3.2-1b at a 128-token prompt, bf16 then W4A16, `--compare`; then bf16 without CUDA graphs
#   profile where a decode step's time goes (bench/gpu_profile.py): 1B and 8B, bf16, int8 KV, W4A16
#   tests   the GPU test files, spread over 12 pytest-xdist workers (Triton compiles on the CPUs); the kernels'
#           on one fixed config each (LLMRUN_TEST_ONE_CONFIG=1)
#   replay  the Qwen pair's replayed acceptance, 4-bit weights, the first HumanEval prompt (about 50 s) (its step
#           times also feed `bench/replay.py simulate` here, for all of them)
#   kv      llama3.1-8b at 8k and 32k positions, bf16 / int8 / int4 KV (bench/kv_speed.py)
# What the H200 took on 2026-11-26 (bench/results/*-lease3.log): the 1B `--compare` runs and the run without graphs
# 144 s; the four profiles about 130 s; the kernel test files 49 s (+ start-up), the model files far longer (2 tests
# in the remaining minute); the replay 50 s; kv_speed at 8k 110 s for two rounds, at 32k more than 150 s for one.
# The memory step's figures are committed; the embedded model's file travels in two calls and is left out. The
# steps' limits total 550 s: give the call 580.
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

export GPU_RESUME=1
# measured again: what the W4A16 GEMV's rewrite (after b79db8d's lease: ~20x off its floor) and the profile's kernel
# table of a graph replay (it was an eager step's) change: the 1B int4 side by side (229.6 tok/s on 2026-11-26),
# the 1B profiles, the Qwen pair's replay on 4-bit weights (bench/GPU_NOTES.md has the predictions)
export GPU_RERUN="llama3.2-1b-int4-p128-n128 profile-llama3.2-1b-p128-weights-int4 profile-llama3.2-1b-p128 qwen-pair-replay-int4"
GPU_PROMPTS=128 step 90 speed llama3.2-1b
step 150 profile
PYTEST_ADDOPTS="-n 12" step 150 tests
GPU_REPLAY_WEIGHTS=int4 GPU_REPLAY_PROMPTS=1 step 60 replay
GPU_KV_REPEAT=1 step 100 kv
# a run cut off by its step's limit leaves its JSON empty or half-written
find "$RESULTS" -name '*.json' -size 0 -delete
cat "$RESULTS/lease.log" >&2
