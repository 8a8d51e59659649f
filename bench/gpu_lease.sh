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
#   kv      llama3.1-8b at 8k and 32k positions, bf16 / int8 / int4 KV, two rounds (bench/kv_speed.py)
#   replay  the Qwen pair's replayed acceptance, 4-bit weights, the first HumanEval prompt (about 35 s) (its step times also
#           feed `bench/replay.py simulate` here, for all of them)
#   tests   the GPU test files, spread over 12 pytest-xdist workers (Triton compiles on the CPUs); the kernels'
#           on one fixed config each (LLMRUN_TEST_ONE_CONFIG=1), since 2026-11-26's lease (all configs timed
#           for every new shape) ran 191 of 640 in 180 s
# What the H200 of 2026-11-26 took (bench/results/*-lease2.log): a `--compare` of the 1B shape 66 s, each 8B run of
# the kv step about 60 s (mostly loading and compiling), the replay about 35 s a prompt, the tests 640 in about
# 10 minutes (191 in 180 s). The memory step's figures are committed; the embedded model's file travels in two
# calls and is left out. The steps' limits total 500 s: give the call 550.
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
# measured again: the 1B bf16 side by side, against its 2026-11-26 figure (685.5 tok/s) after the launch changes
# bench/GPU_NOTES.md lists (predicted ~740)
export GPU_RERUN="llama3.2-1b-auto-p128-n128"
GPU_PROMPTS=128 step 150 speed llama3.2-1b
step 70 profile
GPU_KV_REPEAT=2 step 110 kv
GPU_REPLAY_WEIGHTS=int4 GPU_REPLAY_PROMPTS=1 step 60 replay
PYTEST_ADDOPTS="-n 12" step 110 tests
# a run cut off by its step's limit leaves its JSON empty or half-written
find "$RESULTS" -name '*.json' -size 0 -delete
cat "$RESULTS/lease.log" >&2
