#!/usr/bin/env bash
# The GPU checks and measurements, in one command, for a session that has a GPU:
#
#     LLMRUN_COMMIT=$(git rev-parse --short HEAD) bash bench/gpu.sh [SHAPE ...]
#
# 1. The Triton kernels natively on CUDA (the bf16 cases, marked `gpu`, run here and only here).
# 2. Correctness at a real shape: `llmrun bench --sweep` on the first SHAPE scores the Triton path (bf16) and
#    the plain-PyTorch path against fp32 plain PyTorch on the same random weights (KL, top-1 agreement).
# 3. Every random-weight SHAPE (default: llama3.2-1b llama3-8b) at a short and a long context, its float matrices
#    in bf16 and rounded to 4-bit blocks (--weights int4: W4A16): `llmrun bench --compare` (llmrun against the
#    plain-PyTorch bf16 path, same prompt ids). Each run's JSON goes to bench/results/; a summary table of every
#    run comes last.
set -euo pipefail
cd "$(dirname "$0")/.."
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(llama3.2-1b llama3-8b)
results=bench/results
mkdir -p "$results"
gpu=$(python -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))")
stamp=$(date +%Y-%m-%d)

# a failing test is reported, and the measurements still run: the device time is too scarce to lose them
python -m pytest -q -rs tests/test_triton_ops.py tests/test_triton_attention.py tests/test_triton_quant_matmul.py \
    tests/test_triton_model.py tests/test_cuda_graphs.py || echo "gpu.sh: GPU TESTS FAILED (above); measuring anyway" >&2

written=("$results/$stamp-$gpu-${shapes[0]}-sweep.json")
llmrun bench --random-weights "${shapes[0]}" --prompt-tokens 128 --new-tokens 64 --sweep --goal quality \
    --axis dtype=bf16 --axis weights=auto,dequant --json > "${written[0]}"
for shape in "${shapes[@]}"; do
    for weights in auto int4; do
        for prompt in 128 8000; do
            out="$results/$stamp-$gpu-$shape-$weights-$prompt+128.json"
            llmrun bench --random-weights "$shape" --weights "$weights" --prompt-tokens "$prompt" --new-tokens 128 \
                --ctx 8192 --compare --json > "$out"
            written+=("$out")
        done
    done
done
# CUDA graphs' share: the first SHAPE's short-context bf16 run again with them off
out="$results/$stamp-$gpu-${shapes[0]}-auto-128+128-nographs.json"
LLMRUN_NO_CUDA_GRAPHS=1 llmrun bench --random-weights "${shapes[0]}" --prompt-tokens 128 --new-tokens 128 --ctx 8192 \
    --json > "$out"
written+=("$out")
# 4. The KV cache formats at long context (issue 7): decode speed at 8k and 32k positions for bf16, int8 and int4
#    KV on the 8B shape (quantized KV reads fewer bytes per step), then the formats' quality at a real shape.
for ctx in 8192 32768; do
    for kv in bf16 int8 int4; do
        out="$results/$stamp-$gpu-llama3-8b-kv-$kv-$ctx.json"
        llmrun bench --random-weights llama3-8b --prompt-tokens $((ctx - 192)) --new-tokens 128 --ctx "$ctx" \
            --kv "$kv" --repeat 3 --json > "$out"
        written+=("$out")
    done
done
# 5. Memory (issue 7): the longest context each KV format could hold beside llama3.1-8b's weights (bf16, and 4-bit
#    blocks), from the device's free memory now and the formats' bytes per token (`llmrun info`'s), capped at none
out="$results/$stamp-$gpu-max-context.json"
python - > "$out" <<'PY'
import json, torch
from llmrun.kv_cache import bytes_per_token
from llmrun.shapes import shape_config
cfg = shape_config("llama3.1-8b")
free, total = torch.cuda.mem_get_info()
weights = {"bf16": cfg.n_params * 2, "int4": cfg.n_params // 32 * 20}  # 4-bit blocks: 16 bytes of codes + 4 of fp16 d, m
rows = [{"weights": w, "kv": kv, "max_context": int((free - wb) // bytes_per_token(cfg, kv))}
        for w, wb in weights.items() for kv in ("bf16", "int8", "int4")]
print(json.dumps({"device_free_bytes": free, "device_total_bytes": total, "model": "llama3.1-8b", "rows": rows}))
PY
python -c "import json,sys; [print(r) for r in json.load(open(sys.argv[1]))['rows']]" "$out"
python bench/results_tables.py "${written[@]}"
