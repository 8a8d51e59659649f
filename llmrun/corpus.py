"""The built-in evaluation text: English texts of the Canterbury corpus, taken from the brotli source distribution.

The Canterbury corpus (Arnold & Bell, 1997) is a standard compression benchmark; its English texts are public
domain: `alice29` (Lewis Carroll, Alice's Adventures in Wonderland), `asyoulik` (Shakespeare, As You Like It),
`lcet10` (a Library of Congress workshop report on electronic texts) and `plrabn12` (Milton, Paradise Lost).
The brotli sdist on PyPI ships them in `tests/testdata/`, so `pip` alone can fetch them: no text is committed
here. The sdist is pinned by version and sha256, so every machine evaluates the same bytes. The texts are
extracted into `$XDG_CACHE_HOME/llmrun/corpus` (default `~/.cache/llmrun/corpus`) once and reused.

`python -m llmrun.corpus [SDIST]` fetches (or extracts a hand-downloaded SDIST) and lists the texts.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from llmrun import catalog
from llmrun.errors import LlmrunError

CORPUS = "canterbury"
TEXTS = ("alice29", "asyoulik", "lcet10", "plrabn12")
DEFAULT_TEXT = "alice29"
BROTLI_VERSION = "1.1.0"
BROTLI_SDIST = f"Brotli-{BROTLI_VERSION}.tar.gz"
BROTLI_SHA256 = "81de08ac11bcb85841e440c13611c00b67d3bf82698314928d0b676362546724"
_FETCH = f"pip download --no-deps --no-binary :all: brotli=={BROTLI_VERSION}"
_BY_HAND = f"fetch it by hand ({_FETCH}) and run `python -m llmrun.corpus {BROTLI_SDIST}`, or use --ppl FILE"


def cache_dir() -> Path:
    return catalog.cache_dir() / "corpus"


def is_corpus_spec(spec: str) -> bool:
    """`canterbury` or `canterbury:NAME` (write `./canterbury` for a file of that name)."""
    return spec == CORPUS or spec.startswith(CORPUS + ":")


def corpus_path(spec: str) -> Path:
    """The cached file of `canterbury[:NAME]`, fetched first when the cache lacks it."""
    name = spec.partition(":")[2] if ":" in spec else DEFAULT_TEXT
    if name not in TEXTS:
        raise LlmrunError(f"unknown {CORPUS} text {name!r}; choose one of {', '.join(TEXTS)}")
    path = cache_dir() / f"{name}.txt"
    if not path.is_file():
        fetch()
    return path


def fetch(sdist: Path | None = None) -> list[Path]:
    """Extract every text from `sdist` (default: download the pinned one with pip) into the cache; their paths."""
    with tempfile.TemporaryDirectory(prefix="llmrun-corpus-") as tmp:
        if sdist is None:
            sdist = _download_sdist(Path(tmp))
        try:
            digest = hashlib.sha256(Path(sdist).read_bytes()).hexdigest()
        except OSError as e:
            raise LlmrunError(f"cannot read {sdist} ({e.strerror or e}); {_BY_HAND}") from e
        if digest != BROTLI_SHA256:
            raise LlmrunError(
                f"{Path(sdist).name} has sha256 {digest[:16]}..., not the pinned {BROTLI_SHA256[:16]}... of brotli "
                f"{BROTLI_VERSION}: the text would not be reproducible; {_BY_HAND}"
            )
        return _extract(Path(sdist), cache_dir())


def _download_sdist(dest: Path) -> Path:
    """`pip download` the pinned brotli sdist into `dest` (PyPI, or whatever index pip is configured with)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
               f"brotli=={BROTLI_VERSION}", "-d", str(dest)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LlmrunError(f"cannot run pip to download the brotli {BROTLI_VERSION} sdist ({e}); {_BY_HAND}") from e
    found = sorted(dest.glob("*.tar.gz"))
    if done.returncode != 0 or not found:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        why = lines[-1].strip() if lines else f"exit code {done.returncode}"
        raise LlmrunError(f"cannot download the brotli {BROTLI_VERSION} sdist from PyPI ({why}); {_BY_HAND}")
    return found[0]


def _extract(sdist: Path, dest: Path) -> list[Path]:
    """Copy `*/tests/testdata/NAME.txt` for each of TEXTS out of the tarball (members are read, never extracted
    by their own paths)."""
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            members = {m.name.rsplit("/tests/testdata/", 1)[-1]: m for m in tar.getmembers()
                       if m.isfile() and "/tests/testdata/" in m.name}
            for name in TEXTS:
                member = members.get(f"{name}.txt")
                if member is None:
                    raise LlmrunError(f"{sdist.name} has no tests/testdata/{name}.txt; {_BY_HAND}")
                path = dest / f"{name}.txt"
                partial = path.with_suffix(".part")
                partial.write_bytes(tar.extractfile(member).read())
                partial.replace(path)  # a crash never leaves a truncated text in the cache
                paths.append(path)
    except (OSError, tarfile.TarError) as e:
        raise LlmrunError(f"cannot extract the texts from {sdist} ({e}); {_BY_HAND}") from e
    return paths


def main(argv: list[str]) -> int:
    """Fetch the texts unless cached (or extract them from the sdist given as the one argument); list them."""
    if len(argv) > 1 or any(a.startswith("-") for a in argv):
        print(f"usage: python -m llmrun.corpus [{BROTLI_SDIST}]", file=sys.stderr)
        return 2
    cached = [cache_dir() / f"{name}.txt" for name in TEXTS]
    try:
        paths = cached if not argv and all(p.is_file() for p in cached) else fetch(Path(argv[0]) if argv else None)
    except LlmrunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in paths:
        spec = f"{CORPUS}:{path.stem}" + ("  (default)" if path.stem == DEFAULT_TEXT else "")
        print(f"{spec:32} {path.stat().st_size:>8} bytes  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
