#!/usr/bin/env bash
# bench/gpu.sh's steps in ONE device call, for a lease too short for a call a step (15 minutes of device time, the
# machine's start included), each step under a time limit of its own: a slow one costs only its share, and what
# the others measured still comes back. GPU_RESUME=1: each lease goes on where the committed results of the same
# GPU model stop (bench/results/: a run whose JSON is there, a test its logs record as passed, is left out):
#
#     LLMRUN_COMMIT=$(git rev-parse --short HEAD) RESULTS=/tmp/r bash bench/gpu_lease.sh; tar czf $OUT/r.tgz -C /tmp/r .
#
# carrying .whl and .gpu-model/tokenizer.gguf (bench/gpu_prepare.sh writes both); then commit what came back.
#   gemv    each 1B and 8B decode matmul alone, one row, W4A16 and W8A16, the GEMV's cp.async configs against its
#           register-fetch ones (bench/gemv.py's -regs variants; about 60-90 s with the autotuning)
#   replay  the Qwen pair's replayed acceptance, 4-bit weights, the first HumanEval prompt (about 50 s) (its step
#           times also feed `bench/replay.py simulate` here, for all of them)
#   kv      llama3.1-8b at 8k and 32k positions, bf16 / int8 / int4 KV (bench/kv_speed.py), one round each (the
#           H100 took 227 s for both)
#   tests   the GPU test files, spread over 12 pytest-xdist workers (Triton compiles on the CPUs); the kernels'
#           on one fixed config each (LLMRUN_TEST_ONE_CONFIG=1)
#   profile an 8000-token prefill of the 1B shape into an INT4 cache and a bf16 one (where INT4's goes), the 8B
#           W4A16 step at 128 positions (issue 4's headline shape, never measured in W4A16); each 1B
#           and 8B decode matmul alone, every way it runs (bench/gemv.py: cuBLAS, the GEMV on bf16, W4A16, W8A16,
#           1 row and 9); where a decode step's time goes (bench/gpu_profile.py): 1B bf16 and W4A16, with
#           programmatic dependent launch (LLMRUN_PDL=1), W4A16 on the tensor-core GEMV for every row, llama3-8b at
#           128 positions, the float matmuls on the GEMV, the GEMV's K split further, llama3.1-8b at 8000 with
#           int8 KV and bf16 (on a GPU model that has the earlier ones, these come first): not in this call; a
#           second call on the warm machine (below)
#   speed   llama3.2-1b at a 128-token prompt, W4A16, `--compare`: not in this lease (both GPU models have it);
#           GPU_STEPS=speed in a second call measures it again
# What the H200 took on 2026-11-26 (bench/results/*-lease3.log, *-lease4.log): the 1B `--compare` runs and the run
# without graphs 144 s, the W4A16 `--compare` alone more than 90 s from a cold start (77 s warm); the four profiles
# about 130 s; the kernel test files 49 s (+ start-up), the model files far longer (14 of 73 tests in 120 s: they
# autotune every kernel at every shape); the replay 50 s; kv_speed at 8k 110 s for two rounds, at 32k more than
# 150 s for one. The H100 (*-H100-80GB-HBM3-lease1.log): the W4A16 `--compare` 110 s (its document written), the
# profile step's gemv.py runs and 8 profiles 220 s, the replay 58 s, the kernel test files 757 tests in 120 s
# (none left out: the first on that GPU), the kv step at 8k and 32k, one round each, 227 s. The memory step's
# figures are committed; the embedded model's file travels in two calls and is left out. The steps' limits total
# 510 s: give the call 580.
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
# new: the gemv step (GPU_NOTES: the GEMV's W tiles copied three steps ahead by cp.async, predicted 1.2-1.5x on the
# large W4A16 matrices against the register-fetch configs of the same run). Measured again: the kv step at 8k and
# 32k, one round each: the quantized decode attention no longer waits on its loads within a step (INT4's codes
# copied ahead, the scales fetched a tile ahead; GPU_NOTES predicts INT8 above bf16, INT4 within 5% of INT8), and
# INT4's prefill attends a chunk in one call (ef135f4); the Qwen pair's replay, whose verification blocks of 3-16
# tokens now run on the tensor-core GEMV (b39b2ce; the H100's first lease: a 9-token block 2.53 one-token steps,
# greedy 1.16x; predicted ~1.5 steps and ~1.3x). The tests of what changed since run again though they passed; the
# model files have never run to their end in a lease. The profile step (the prefill profiles, the 8B W4A16 step,
# the 8B's INT8 split kernel at 8k) goes in a second call on the warm machine:
#     GPU_RESUME=1 GPU_RERUN="profile-llama3-8b-p128 profile-llama3.2-1b-p128 profile-llama3.2-1b-p128-weights-int4" \
#         LLMRUN_COMMIT=... RESULTS=/tmp/r GPU_STEPS=profile timeout 250 bash bench/gpu.sh
# (its first three profiles measure the launches a layer, 12 -> 8, and the float matmuls on the GEMV; each profile
# also times a reply's decode loop pipelined and fed from the host, GPU_NOTES' prediction for the pipelining; the
# replay's plain rows run pipelined too, and its T 0.8 rows measure the sampling that waits once a token)
export GPU_RERUN="qwen-pair-replay-int4 llama3.1-8b-kv-speed-8192 llama3.1-8b-kv-speed-32768"
export GPU_RETEST="test_triton_attention test_triton_quant_matmul test_speculative test_cuda_graphs test_triton_model"
step 90 gemv
GPU_KV_REPEAT=1 step 230 kv
GPU_REPLAY_WEIGHTS=int4 GPU_REPLAY_PROMPTS=1 step 60 replay
PYTEST_ADDOPTS="-n 12" step 130 tests
# a run cut off by its step's limit leaves its JSON empty or half-written
find "$RESULTS" -name '*.json' -size 0 -delete
cat "$RESULTS/lease.log" >&2
