#!/usr/bin/env bash
# bench/gpu.sh's steps in ONE device call, for a lease too short for a call a step (15 minutes of device time, the
# machine's start included: about 12 of them for commands), each step under a time limit of its own: a slow one
# costs only its share, and what the others measured still comes back. GPU_RESUME=1: each lease goes on where the
# committed results of the same GPU model stop (bench/results/: a run whose JSON is there, a test its logs record
# as passed, is left out). Two calls, the second on the warm machine at once (it keeps the first's files):
#
#   1. carry [".whl", ".gpu-model/tokenizer.gguf", ".gpu-model/a", ".gpu-cache/compiled.tgz"], timeout_s 480:
#        export PYTHONUNBUFFERED=1; LLMRUN_COMMIT=$(git rev-parse --short HEAD) RESULTS=/tmp/r \
#            bash bench/gpu_lease.sh; tar czf $OUT/r.tgz -C /tmp/r .
#   2. carry [".whl", ".gpu-model/b", ".gpu-model/SHA256SUM"], timeout_s 250:
#        export PYTHONUNBUFFERED=1; LLMRUN_COMMIT=... RESULTS=/tmp/r GPU_STEPS=embedded GPU_RESUME=1 \
#            LLMRUN_TEST_ONE_CONFIG=1 timeout 235 bash bench/gpu.sh; bash bench/gpu_cache.sh save $OUT/compiled.tgz;
#            tar czf $OUT/r2.tgz -C /tmp/r .
#
# (bench/gpu_prepare.sh writes .whl/ and .gpu-model/; .gpu-cache/compiled.tgz is the last lease's compiled kernels,
# bench/gpu_cache.sh, where there is one: carried, call 1 compiles only what changed. The 64 MiB a call carries:
# the tree ~4, half the model 47, the cache what is left: drop it from call 1 before `a`.) Then give the machine
# back, unpack both .tgz into bench/results/, keep compiled.tgz as .gpu-cache/compiled.tgz, and commit the results.
#
# Correctness first: what no lease has yet run to its end, then what the last changes predict.
#   tests    the GPU test files: the model files first (the whole model on the Triton path, CUDA graphs, the
#            compiled baseline, sampling, AWQ on the GPU: never run to their end in a lease), then the kernel files'
#            tests of what changed (GPU_RETEST); 12 pytest-xdist workers, one fixed config a kernel
#            (LLMRUN_TEST_ONE_CONFIG=1). The H200's model files once took 120 s for 14 of 73 tests, autotuning.
#   sweep    correctness at a real shape: the 1B's Triton path in bf16 (autotuned, as run) and plain PyTorch against
#            fp32 plain PyTorch on the same random weights: KL and top-1 (`llmrun bench --sweep`). Never run.
#   profile  the 8B and 1B bf16 steps and the 1B W4A16 step (bench/gpu_profile.py: graph step, kernels, floor), each
#            with a reply's decode loop pipelined and fed from the host (GPU_NOTES predicts the pipelined loop within
#            ~1% of the graph step, the host-fed 3-5% above it; the launches a layer 12 -> 8, the 8B at 128 positions
#            ~85-87% of its floor). About 25 s a profile on the H100.
#   replay   the Qwen pair's replayed acceptance, 4-bit weights, the first HumanEval prompt (about 50-60 s): its
#            plain rows pipelined, its T 0.8 rows the sampling that waits once a token, verification blocks on the
#            tensor-core GEMV (the H100's first lease: greedy 1.16x; predicted ~1.3x).
# Call 2, `embedded`: the real embedded model joined from the halves the two calls carried: teacher-forced against
# llama.cpp's F32 continuations through the Triton kernels and CUDA graphs in fp32 and bf16, greedy speculative
# decoding against plain greedy (issue 4's top-1 >= 99%, never measured on a GPU); bench/speculative.py's n-gram and
# self rows on the GPU (issue 6's n-gram speedups there: copy-heavy >= 2.5x, open-ended >= 0.95x); `--compare`.
# Left for a later lease (gpu.sh runs them by GPU_STEPS): the kv step again at 8k and 32k (the quantized attention's
# loads copied ahead: GPU_NOTES predicts INT8 above bf16, INT4 within 5% of INT8; the H100 took 227 s for both,
# one round each), the gemv step (cp.async configs against the register-fetch ones, 60-90 s).
# Steps' limits: 200 + 70 + 110 + 60 = 440 s, plus installing gguf and llmrun: give the call 480.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
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
# every GPU test again, though many passed before on this GPU: each file's kernels or paths changed since (the
# GEMV's cp.async pipeline, the quantized attention's loads ahead, the fused launches, the pipelined decoding)
export GPU_RETEST="tests/"
PYTEST_ADDOPTS="-n 12" step 200 tests
step 70 sweep llama3.2-1b
GPU_RERUN="profile-llama3-8b-p128 profile-llama3.2-1b-p128 profile-llama3.2-1b-p128-weights-int4" step 110 profile
GPU_RERUN="qwen-pair-replay-int4" GPU_REPLAY_WEIGHTS=int4 GPU_REPLAY_PROMPTS=1 step 60 replay
# a run cut off by its step's limit leaves its JSON empty or half-written
find "$RESULTS" -name '*.json' -size 0 -delete
cat "$RESULTS/lease.log" >&2
[ -z "${OUT:-}" ] || bash bench/gpu_cache.sh save "$OUT/compiled.tgz"
