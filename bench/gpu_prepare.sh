#!/usr/bin/env bash
# Run HERE (a machine that reaches PyPI, with the embedded model installed), before a lent GPU machine's first call.
# It fills two git-ignored folders for the device calls' `carry`:
#   .whl/        the wheels of what llmrun needs that the lent machines' image lacks. The image has torch, triton,
#                typer, rich, safetensors, sentencepiece, tokenizers, huggingface-hub, jinja2 and numpy (the device
#                tool's KINDS.md); gguf is missing. bench/gpu.sh installs it there from .whl/, and llmrun itself
#                from the working tree, when llmrun is not importable. xgrammar is left out: structured output's
#                tests skip without it, and gpu.sh runs none of them.
#   .gpu-model/  the embedded model's GGUF (98 MB) cut in two, `a` and `b`, each under the 64 MiB one call carries,
#                and its SHA256SUM. Carried by two calls in a row (a then b, the machine kept warm between them),
#                gpu.sh's `embedded` step joins them there and checks the sum. And tokenizer.gguf, the model's
#                metadata alone (1.7 MB): the tokenizer that random weights take where the model is not installed.
# Last it prints the calls to make, in order.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl .gpu-model && mkdir .whl .gpu-model
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "gguf>=0.10"
model=$(python3 -c "from llmrun.loading import embedded_model_path; print(embedded_model_path())")
half=$(( ($(stat -c %s "$model") + 1) / 2 ))
head -c "$half" "$model" > .gpu-model/a
tail -c +"$((half + 1))" "$model" > .gpu-model/b
(cd "$(dirname "$model")" && sha256sum "$(basename "$model")") > .gpu-model/SHA256SUM
python3 -c "import sys; from llmrun.gguf_file import write_metadata_only; write_metadata_only(*sys.argv[1:])" \
    "$model" .gpu-model/tokenizer.gguf
ls -l .whl .gpu-model
commit=$(git rev-parse --short HEAD)
[ -z "$(git status --porcelain --untracked-files=no)" ] || commit="$commit-dirty"
cache=""  # the last lease's compiled kernels (bench/gpu_cache.sh), where this checkout kept them
[ ! -f .gpu-cache/compiled.tgz ] || cache=', ".gpu-cache/compiled.tgz"'
run() {  # run N STEPS [SHAPE...]: the command of device call N, its results tarred into $OUT however it ends
    local n=$1 steps=$2
    shift 2
    echo "LLMRUN_COMMIT=$commit RESULTS=/tmp/r$n GPU_STEPS=\"$steps\" timeout 570 bash bench/gpu.sh${*:+ $*};" \
        "tar czf \$OUT/results$n.tgz -C /tmp/r$n ."
}
cat <<CALLS

A 15-minute lease (the machine's start included): two calls, the second at once on the warm machine (it keeps
the first's files), going on where bench/results/ stops (bench/gpu_lease.sh's header says what each step runs);
then give the machine back.
  1. carry [".whl", ".gpu-model/tokenizer.gguf", ".gpu-model/a"$cache], timeout_s 500:
     export PYTHONUNBUFFERED=1; LLMRUN_COMMIT=$commit RESULTS=/tmp/r bash bench/gpu_lease.sh;
     tar czf \$OUT/r.tgz -C /tmp/r .
  2. carry [".whl", ".gpu-model/b", ".gpu-model/SHA256SUM"], timeout_s 250:
     export PYTHONUNBUFFERED=1; LLMRUN_COMMIT=$commit RESULTS=/tmp/r GPU_STEPS=embedded GPU_RESUME=1
     GPU_RERUN="profile-smollm2-p128 smollm2-speculative" timeout 235 bash bench/gpu.sh;
     bash bench/gpu_cache.sh save \$OUT/compiled.tgz; tar czf \$OUT/r2.tgz -C /tmp/r .
(Lower both limits when less is left. Keep the compiled.tgz that comes back as .gpu-cache/compiled.tgz.)
A longer one: these calls, in this order, each within 30 s of the last (the machine stays warm and keeps what came
before; a cold one starts bare, so every call carries .whl):
  1. carry [".whl", ".gpu-model/a"]
     $(run 1 tests)
  2. carry [".whl", ".gpu-model/b", ".gpu-model/SHA256SUM"]
     $(run 2 embedded)
  3. carry [".whl"]
     $(run 3 replay)
  4. carry [".whl"]
     $(run 4 "sweep speed" llama3.2-1b)
  5. carry [".whl"]
     $(run 5 speed llama3-8b)
  6. carry [".whl"]
     $(run 6 "kv memory")
Then unpack each .tgz into bench/results/, add their lines to bench/RESULTS.md (python bench/results_tables.py
bench/results/FILE.json prints a bench run's table; speculative.py and replay.py write their own .md), and commit
them.
CALLS
