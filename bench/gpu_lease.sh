#!/usr/bin/env bash
# bench/gpu.sh's steps in ONE device call, for a lease too short for a call a step (15 minutes of device time, the
# machine's start included: about 12 of them for commands), each step under a time limit of its own: a slow one
# costs only its share, and what the others measured still comes back. GPU_RESUME=1: each lease goes on where the
# committed results of the same GPU model stop (bench/results/: a run whose JSON is there, a test its logs record
# as passed, is left out). Two calls, the second on the warm machine at once (it keeps the first's files):
#
#   1. carry [".whl", ".gpu-model/tokenizer.gguf", ".gpu-model/a", ".gpu-cache/compiled.tgz"], timeout_s 500:
#        export PYTHONUNBUFFERED=1; LLMRUN_COMMIT=$(git rev-parse --short HEAD) RESULTS=/tmp/r \
#            bash bench/gpu_lease.sh; tar czf $OUT/r.tgz -C /tmp/r .
#   2. carry [".whl", ".gpu-model/b", ".gpu-model/SHA256SUM"], timeout_s 250:
#        export PYTHONUNBUFFERED=1; LLMRUN_COMMIT=... RESULTS=/tmp/r GPU_STEPS=embedded GPU_RESUME=1 \
#            GPU_RERUN="profile-smollm2-p128 smollm2-speculative" timeout 235 bash bench/gpu.sh;
#            bash bench/gpu_cache.sh save $OUT/compiled.tgz; tar czf $OUT/r2.tgz -C /tmp/r .
#
# (bench/gpu_prepare.sh writes .whl/ and .gpu-model/; .gpu-cache/compiled.tgz is the last lease's compiled kernels,
# bench/gpu_cache.sh, where there is one: carried, call 1 compiles only what changed. The 64 MiB a call carries:
# the tree ~4, half the model 47, the cache what is left: drop it from call 1 before `a`.) Then give the machine
# back, unpack both .tgz into bench/results/, keep compiled.tgz as .gpu-cache/compiled.tgz, and commit the results.
#
# Correctness first. The H100's third lease (2026-11-28) passed every test it reran (175) and measured the 8B in
# W4A16, INT4's 8k prefill and the embedded model's steps and speculation; what is left, by GPU_RESUME=1:
#   tests    the kernel files it did not reach (test_triton_quant_matmul, test_triton_kv_write), and again the
#            CUDA-graph file (a graph's span now starts at 256 keys), the INT4 writes and prompt-chunk attention
#            (a chunk's write now the two fused launches, its mask made once a chunk) and the decode attention's
#            file (its combine takes all of a program's rows at once; since, no load masks a position, nor a
#            channel at a power-of-two head_dim: every split config's bits against the reference again):
#            GPU_RETEST; 12 workers.
#   half2    issue 4's W4A16 gap (8B: 47% of its floor, 75% asked): the GEMV's 4-bit weights dequantized and
#            multiplied in fp16 pairs (LLMRUN_GEMV_HALF2=1, sm_90 SASS 282 instructions a step against 385): its
#            tests (its PTX never ran), the 8B's matmuls alone against the fp32-weight GEMV, its 8B W4A16 step.
#   replay   the Qwen lookup replay (it failed at its first reply's cut character: fixed), predicted code-edit
#            2.6-3.1x greedy (issue 6 asks >= 2.5x), open and summarize 1.0-1.2x; then the Qwen pair's first prompt.
#   profile  INT4's 8000-token prefill again (774 ms, ~110 launches a layer and chunk; predicted 420-480 ms), the 1B
#            W4A16 step again (MIN_SPAN 256: predicted below its 0.996 ms), then the shapes' remaining profiles.
# Call 2, `embedded`: the real embedded model joined from the halves the two calls carried: its tests (the CUDA-graph
# ones too, left there by call 1), its step profiled again with each speculative block's kernels beside the step's
# (the block forwards of 2/4/8 tokens took 1.415/1.708/1.808 ms against the step's 0.958; predicted with MIN_SPAN
# 256: the step ~0.85-0.90, the blocks ~1.25-1.3/1.35-1.5/1.35-1.55), the same at 600 positions (4 splits: the
# combine of all rows at once; predicted each block within 0.1 ms of its p128 time), and bench/speculative.py's rows
# again (GPU_RERUN), `--compare` and the sweep.
# Left for a later lease (gpu.sh runs them by GPU_STEPS): the kv step again at 8k and 32k, the gemv step.
# Steps' limits: 100 + 150 + 40 + 120 + 60 = 470 s, plus installing gguf and llmrun: give the call 500.
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
# the tests not yet passed on this GPU, and again those of the code changed since they passed (the graphs' span,
# INT4's writes of any length, its prompt chunk's attention)
export GPU_RETEST="tests/test_cuda_graphs.py tests/test_triton_kv_write.py int4_prompt_chunk"
GPU_RETEST+=" tests/test_triton_attention.py"
PYTEST_ADDOPTS="-n 12" step 100 tests
# issue 4's W4A16 gap: the GEMV in fp16 pairs (LLMRUN_GEMV_HALF2=1): its tests, the 8B's matmuls alone, its step
step 150 half2
# PDL's fourth bits case (H2O over INT4, Q8_0 weights): started in both earlier leases' test steps and never reported
# before their limits, where its three others passed; alone here, under a limit of its own. A pass lets PDL be on by
# default (its profiles: -14% on the 1B W4A16 step, -3.6% bf16); a hang is the finding.
echo "gpu_lease: PDL's H2O bits case (at most 40 s)" >&2
timeout -k 5 40 python3 -m pytest -q -p no:cacheprovider \
    "tests/test_cuda_graphs.py::test_pdl_launches_give_the_plain_launches_bits[bf16-Q8_0-int4-h2o-False]" 2>&1 \
    | tail -n 30 > "$RESULTS/pdl-h2o-bits.log"
echo "gpu_lease: PDL's H2O bits case: exit ${PIPESTATUS[0]} ($(tail -n 1 "$RESULTS/pdl-h2o-bits.log"))" \
    | tee -a "$RESULTS/lease.log" >&2
GPU_RERUN="qwen-pair-replay-int4" GPU_REPLAY_WEIGHTS=int4 GPU_REPLAY_PROMPTS=1 step 120 replay
GPU_RERUN="profile-llama3.2-1b-p8000-kv-int4-prefill profile-llama3.2-1b-p128-weights-int4" step 60 profile
# a run cut off by its step's limit leaves its JSON empty or half-written
find "$RESULTS" -name '*.json' -size 0 -delete
cat "$RESULTS/lease.log" >&2
[ -z "${OUT:-}" ] || bash bench/gpu_cache.sh save "$OUT/compiled.tgz"
