#!/usr/bin/env bash
# Run HERE (a machine that reaches PyPI), before a lent GPU machine's first call: the wheels of what llmrun needs
# that the lent machines' image lacks, into .whl/ (git-ignored; name it in the device call's `carry`). The image
# has torch, triton, typer, rich, safetensors, sentencepiece, tokenizers, huggingface-hub, jinja2 and numpy
# (the device tool's KINDS.md); gguf is missing. bench/gpu.sh installs it there from .whl/, and llmrun itself
# from the working tree, when llmrun is not importable. xgrammar is left out: structured output's tests skip
# without it, and gpu.sh runs none of them.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "gguf>=0.10"
ls -l .whl
