"""What models are on this machine: the embedded alias, models in the Hugging Face hub cache, and the checkpoints
`llmrun quantize` wrote (recorded in an index under llmrun's cache directory). Also the shell completion of a
MODEL argument, which runs on every Tab: plain directory listings only, no torch and no huggingface_hub.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llmrun.errors import LlmrunError, parse_json
from llmrun.loading import DEFAULT_MODEL, embedded_model_path


def cache_dir() -> Path:
    """llmrun's cache: `$XDG_CACHE_HOME/llmrun`, by default `~/.cache/llmrun`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmrun"


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloaded repositories, found as huggingface_hub finds it."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


@dataclass(frozen=True)
class CatalogEntry:
    model: str  # what to pass as MODEL
    kind: str  # "embedded" | "hub" | "quantized"
    path: str
    bytes: int  # on disk
    details: dict = field(default_factory=dict)  # quantized: method, bits, group_size, quantized_from

    def to_json(self) -> dict:
        return asdict(self)


def embedded_entry() -> CatalogEntry | None:
    """The embedded model, or None when its package is not installed."""
    try:
        path = embedded_model_path()
    except LlmrunError:
        return None
    return CatalogEntry(DEFAULT_MODEL, "embedded", str(path), path.stat().st_size)


# --- the Hugging Face hub cache: models--ORG--NAME/{refs/main, snapshots/COMMIT/...} ----------------------------


def _snapshot(repo: Path) -> Path | None:
    """The snapshot `main` points to, else the newest one."""
    try:
        commit = (repo / "refs" / "main").read_text().strip()
        if (repo / "snapshots" / commit).is_dir():
            return repo / "snapshots" / commit
    except OSError:
        pass
    try:
        snapshots = [p for p in (repo / "snapshots").iterdir() if p.is_dir()]
    except OSError:
        return None
    return max(snapshots, key=lambda p: p.stat().st_mtime, default=None)


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size  # through the snapshot's symlink to the blob
    except OSError:  # a dangling link: a download that never finished
        return 0


def hub_entries(with_sizes: bool = True) -> list[CatalogEntry]:
    """Cached hub models, as MODEL specs: `org/name` for a repository with config.json (size: its other files)
    and `org/name:FILE.gguf` for each GGUF file in one."""
    try:
        repos = sorted(p for p in hub_cache_dir().iterdir() if p.name.startswith("models--") and p.is_dir())
    except OSError:
        return []
    entries = []
    for repo in repos:
        org, _, name = repo.name.removeprefix("models--").partition("--")
        snapshot = _snapshot(repo)
        if not name or snapshot is None:
            continue
        spec = f"{org}/{name}"
        files = [p for p in snapshot.rglob("*") if p.is_file()]  # (a link to a blob that is gone is no file)
        ggufs = sorted(p for p in files if p.suffix == ".gguf")
        if (snapshot / "config.json").is_file():
            size = sum(_file_size(p) for p in files if p.suffix != ".gguf") if with_sizes else 0
            entries.append(CatalogEntry(spec, "hub", str(snapshot), size))
        for p in ggufs:
            spec_file = f"{spec}:{p.relative_to(snapshot).as_posix()}"
            entries.append(CatalogEntry(spec_file, "hub", str(p), _file_size(p) if with_sizes else 0))
    return entries


# --- checkpoints written by `llmrun quantize` -----------------------------------------------------------------


def quantized_index_path() -> Path:
    return cache_dir() / "quantized.json"


def _read_index() -> list[str]:
    try:
        dirs = parse_json(quantized_index_path().read_text())
    except (OSError, ValueError):  # none yet, or damaged: it is only a cache of paths
        return []
    return [d for d in dirs if isinstance(d, str)] if isinstance(dirs, list) else []


def _write_index(dirs: list[str]) -> None:
    """Atomically: a concurrent reader sees the old index or the new one."""
    path = quantized_index_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".quantized.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(dirs, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def record_quantized(out_dir: str | Path) -> None:
    """Remember a checkpoint directory `llmrun quantize` wrote, for `llmrun models`. Raises OSError when the
    cache directory cannot be written."""
    path = str(Path(out_dir).resolve())
    dirs = _read_index()
    if path not in dirs:
        _write_index([*dirs, path])


def _field_object(config, key: str) -> dict:
    """`config[key]` when both are JSON objects, else empty: a listing shows what a hand-edited config.json
    still says rather than failing on it."""
    value = config.get(key) if isinstance(config, dict) else None
    return value if isinstance(value, dict) else {}


def quantized_entries() -> list[CatalogEntry]:
    """The recorded checkpoints that still exist, with method, bits and group size from their config.json; the
    ones that vanished are dropped from the index."""
    dirs = _read_index()
    entries, kept = [], []
    for d in dirs:
        try:
            config = parse_json((Path(d) / "config.json").read_text())
        except (OSError, ValueError):
            continue
        kept.append(d)
        quant, ours = (_field_object(config, key) for key in ("quantization_config", "llmrun"))
        details = {"method": ours.get("method") or quant.get("quant_method"), "bits": quant.get("bits"),
                   "group_size": quant.get("group_size"), "quantized_from": ours.get("quantized_from")}
        size = sum(_file_size(p) for p in Path(d).iterdir() if p.is_file())
        entries.append(CatalogEntry(d, "quantized", d, size, details))
    if kept != dirs:
        try:
            _write_index(kept)
        except OSError:
            pass  # listing must not fail on a read-only cache; the next write tries again
    return entries


def all_entries() -> list[CatalogEntry]:
    embedded = embedded_entry()
    return [*([embedded] if embedded else []), *hub_entries(), *quantized_entries()]


# --- shell completion of MODEL ---------------------------------------------------------------------------------


def _local_paths(incomplete: str) -> list[str]:
    """`.gguf` files and directories starting with `incomplete` (a path as typed: relative, absolute or `~/...`).
    A directory with config.json is a model and completes as one; others end in `/` so the user can go on."""
    head, sep, prefix = incomplete.rpartition("/")
    folder = Path(head + sep or ".").expanduser()
    try:
        children = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return []
    found = []
    for child in children:
        if not child.name.startswith(prefix) or (child.name.startswith(".") and not prefix.startswith(".")):
            continue
        typed = head + sep + child.name
        try:
            if child.is_dir():
                found.append(typed if os.path.isfile(os.path.join(child.path, "config.json")) else typed + "/")
            elif child.name.endswith(".gguf"):
                found.append(typed)
        except OSError:
            continue
    return found


def complete_model(incomplete: str) -> list[tuple[str, str] | str]:
    """Completions of a MODEL argument: the alias, local GGUF files and directories, cached hub models. Shells
    that show descriptions (zsh, fish) get one for the alias and the hub models."""
    found: list[tuple[str, str] | str] = []
    if DEFAULT_MODEL.startswith(incomplete):
        found.append((DEFAULT_MODEL, "the embedded model"))
    local = _local_paths(incomplete)
    found += local
    found += [(e.model, "cached hub model") for e in hub_entries(with_sizes=False) if e.model.startswith(incomplete)]
    if found == local and len(local) == 1 and local[0].endswith("/"):
        # One plain directory matches: offer what is inside, so a second Tab is not needed to descend (bash
        # inserts the common prefix, the directory, without a space after it).
        return _local_paths(local[0]) or local
    return found
