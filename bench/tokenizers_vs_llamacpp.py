"""llmrun's GGUF tokenizers against llama.cpp's: its own vocabulary tests, and (with llama-cpp-python installed)
llama.cpp tokenizing a set of mixed texts itself.

    python bench/tokenizers_vs_llamacpp.py VOCAB_DIR [--llama-cpp] [--texts 200]

VOCAB_DIR holds llama.cpp's vocabulary-only GGUFs and their tests, `ggml-vocab-NAME.gguf` with
`ggml-vocab-NAME.gguf.inp` (texts, separated by a `__ggml_vocab_test__` line) and `.out` (the ids llama.cpp
gives, a line a text): llama.cpp's `models/` folder, vendored in llama-cpp-python's source distribution too
(`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`, then `vendor/llama.cpp/models/`).
`--llama-cpp` also has llama.cpp (`import llama_cpp`, vocabulary only) tokenize the fixed texts below and
`--texts` random strings over scripts, digits, punctuation and whitespace, and compares.

Prints a table: a vocabulary a row, its model and pre-tokenizer, llmrun's warnings, the mismatches on llama.cpp's
tests and on the extra texts; exits 1 where any id differs.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from llmrun.gguf_file import GGUFFile  # noqa: E402
from llmrun.tokenizer import tokenizer_from_gguf  # noqa: E402

SEPARATOR = "\n__ggml_vocab_test__\n"
FIXED = [
    "Hello world, this is a test of 12345 numbers and 3.14159 pi.",
    "def foo(x):\n    return x**2 + 1  # comment\n\n\tindent\r\nwindows",
    "Γειά σου κόσμε! Привет, мир! გამარჯობა მსოფლიო Բարեւ աշխարհ",
    "日本語のテキストと中文混合，한국어 텍스트도 있습니다。１２３ＡＢＣ",
    "Emoji 🦙🔥 and ZWJ 👨‍👩‍👧 and accents: café naïve résumé Ångström",
    "   leading spaces   and trailing   \n\n\n  ",
    "camelCaseWords and SCREAMING_SNAKE and kebab-case-words, URL https://example.com/a/b?c=1&d=2",
    "Math: ∑_{i=1}^{n} x_i² ≤ ∞ ∀x∈ℝ; ℂ ℍ ℕ 𝐀𝐁𝐂 𝔄𝔅",
    "Tabs\tand\tnewlines\n\nmixed \u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "'s 't 're 've 'm 'll 'd — I'm you're we've they'd it's O'Neil's",
    "0123456789 00 000 0000 1,000,000 1.5e-10 ٠١٢٣ ४५६",
]
ALPHABET = "aZ 1\n\t.,!?'\"()[]{}<>-_/\\:;中文ფΣσé🦙가"


def vocab_tests(gguf: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's texts for `gguf` and the ids it gives them."""
    with open(f"{gguf}.inp", encoding="utf-8", newline="") as f:  # (the texts' own "\r" kept)
        texts = f.read().removesuffix(SEPARATOR).split(SEPARATOR)
    ids = Path(f"{gguf}.out").read_text(encoding="utf-8").split("\n")
    if len(ids) < len(texts):
        sys.exit(f"error: {gguf}.out has {len(ids)} lines for {len(texts)} texts")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids)]


def extra_texts(n: int) -> list[str]:
    rng = random.Random(0)
    return FIXED + ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vocab_dir", type=Path)
    parser.add_argument("--llama-cpp", action="store_true", help="also compare with llama.cpp itself on more texts")
    parser.add_argument("--texts", type=int, default=200, help="random texts besides the fixed ones (--llama-cpp)")
    args = parser.parse_args()
    files = sorted(p for p in args.vocab_dir.glob("ggml-vocab-*.gguf") if Path(f"{p}.inp").is_file())
    if not files:
        sys.exit(f"error: {args.vocab_dir} holds no ggml-vocab-*.gguf with its .inp/.out tests")
    extra = extra_texts(args.texts) if args.llama_cpp else []
    if args.llama_cpp:
        import llama_cpp
    rows, failed = [], False
    for gguf in files:
        meta = GGUFFile(gguf).metadata
        name = gguf.name.removeprefix("ggml-vocab-").removesuffix(".gguf")
        try:
            tok = tokenizer_from_gguf(meta)
        except Exception as e:  # (a tokenizer type llmrun does not read: a row that says so)
            rows.append((name, str(meta.get("tokenizer.ggml.model")), str(meta.get("tokenizer.ggml.pre")),
                         f"not read: {e}"[:60], "-", "-"))
            continue
        tests = vocab_tests(gguf)
        bad = sum(tok.encode(text, special=False, add_bos=False) != ids for text, ids in tests)
        extra_bad = "-"
        if extra:
            reference = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
            extra_bad = sum(tok.encode(text, special=False, add_bos=False)
                            != reference.tokenize(text.encode(), add_bos=False, special=False) for text in extra)
            failed |= extra_bad > 0
        failed |= bad > 0
        rows.append((name, str(meta.get("tokenizer.ggml.model")), str(meta.get("tokenizer.ggml.pre")),
                     "; ".join(tok.warnings)[:60] or "-", f"{bad}/{len(tests)}",
                     f"{extra_bad}/{len(extra)}" if extra else "-"))
    head = ("vocabulary", "model", "pre", "llmrun's warnings", "llama.cpp tests differing", "extra texts differing")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
