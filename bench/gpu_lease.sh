#!/usr/bin/env bash
# bench/gpu.sh's steps in ONE device call, for a lease too short for a call a step (15 minutes of device time, the
# machine's start included), each step under a time limit of its own: a slow one costs only its share, and what
# the others measured still comes back. GPU_RESUME=1: each lease goes on where the committed results of the same
# GPU model stop (bench/results/: a run whose JSON is there, a test its logs record as passed, is left out):
#
#     LLMRUN_COMMIT=$(git rev-parse --short HEAD) RESULTS=/tmp/r bash bench/gpu_lease.sh; tar czf $OUT/r.tgz -C /tmp/r .
#
# carrying .whl and .gpu-model/tokenizer.gguf (bench/gpu_prepare.sh writes both); then commit what came back.
#   speed   llama3.2-1b at a 128-token prompt, W4A16, `--compare` (its bf16 torch.compile baseline included)
#   profile each 1B and 8B decode matmul alone, every way it runs (bench/gemv.py: cuBLAS, the GEMV on bf16, W4A16, W8A16,
#           1 row and 9); where a decode step's time goes (bench/gpu_profile.py): 1B bf16 and W4A16, both again
#           with programmatic dependent launch (LLMRUN_PDL=1) (and W4A16 with the GEMV's
#           K split further; bf16 with its float matmuls on the GEMV, not cuBLAS), llama3-8b at 128 positions,
#           llama3.1-8b at 8000 with int8 KV
#   tests   the GPU test files, spread over 12 pytest-xdist workers (Triton compiles on the CPUs); the kernels'
#           on one fixed config each (LLMRUN_TEST_ONE_CONFIG=1)
#   replay  the Qwen pair's replayed acceptance, 4-bit weights, the first HumanEval prompt (about 50 s) (its step
#           times also feed `bench/replay.py simulate` here, for all of them)
#   kv      llama3.1-8b at 8k and 32k positions, bf16 / int8 / int4 KV (bench/kv_speed.py): not in this lease
#           (32k takes more than 150 s), a second call on the warm machine if time is left, 8k measured again for
#           INT4's prefill (c60f1e8: the cache dequantized once a chunk, not 16 times):
#           GPU_RESUME=1 GPU_RERUN=llama3.1-8b-kv-speed-8192 LLMRUN_COMMIT=... RESULTS=/tmp/r GPU_KV_REPEAT=1 \
#               GPU_STEPS=kv timeout 400 bash bench/gpu.sh
#           or first, if the profile's `-gemv-dot` run beat the plain W4A16 one on its 9-row blocks, the replay on
#           the tensor-core GEMV (about 50 s): LLMRUN_GEMV_DOT=1 GPU_REPLAY_TAG=-gemv-dot GPU_REPLAY_WEIGHTS=int4 \
#               GPU_REPLAY_PROMPTS=1 GPU_RESUME=1 LLMRUN_COMMIT=... RESULTS=/tmp/r GPU_STEPS=replay bash bench/gpu.sh
# What the H200 took on 2026-11-26 (bench/results/*-lease3.log, *-lease4.log): the 1B `--compare` runs and the run
# without graphs 144 s, the W4A16 `--compare` alone more than 90 s from a cold start (77 s warm); the four profiles
# about 130 s; the kernel test files 49 s (+ start-up), the model files far longer (14 of 73 tests in 120 s: they
# autotune every kernel at every shape); the replay 50 s; kv_speed at 8k 110 s for two rounds, at 32k more than
# 150 s for one (left out here). The memory step's figures are committed; the embedded model's file travels in two
# calls and is left out. The steps' limits total 520 s: give the call 580.
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
# measured again: what the GEMV's third version (6c314d3: the tile dequantized once for every row of x, no barrier
# or shuffle in its loop) and its split-K summed in its own launch (3935e34) change, against the fourth lease's 509.3
# tok/s, its 1.40 ms of GEMV a 1B step, and the Qwen pair's 9-token block at 5.03 steps; the 1B bf16 step without
# RoPE's two table copies a layer (dccaf4c), against a 1.218 ms graph step (the profile; its `llmrun bench` is left
# for a later lease); the 8B's INT8 attention with its scales loaded once a group (against 701 us a step at 8k).
# New: each 1B and 8B matmul alone (bench/gemv.py, with the tensor-core GEMV's variants), programmatic dependent
# launch (LLMRUN_PDL=1) against plain launches, W4A16 on the tensor-core GEMV (LLMRUN_GEMV_DOT=1),
# the 1B's float matmuls on the GEMV (LLMRUN_GEMV_FLOAT=1) against cuBLAS, and llama3-8b's graph step at 128
# positions against its floor (issue 4's headline shape); the profiles in that order, the last cut first.
# bench/GPU_NOTES.md has the predictions. The tests of what changed since (the GEMV, PDL, the attention's autotuner
# key, the embedding's lookup) run again though they passed.
export GPU_RERUN="llama3.2-1b-int4-p128-n128 profile-llama3.2-1b-p128 profile-llama3.2-1b-p128-weights-int4"
GPU_RERUN+=" qwen-pair-replay-int4 profile-llama3.1-8b-p8000-kv-int8"
export GPU_RETEST="test_triton_quant_matmul test_triton_attention test_triton_model test_cuda_graphs"
GPU_WEIGHTS=int4 GPU_PROMPTS=128 step 110 speed llama3.2-1b
step 220 profile
GPU_REPLAY_WEIGHTS=int4 GPU_REPLAY_PROMPTS=1 step 70 replay
PYTEST_ADDOPTS="-n 12" step 120 tests
# a run cut off by its step's limit leaves its JSON empty or half-written
find "$RESULTS" -name '*.json' -size 0 -delete
cat "$RESULTS/lease.log" >&2
