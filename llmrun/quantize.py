"""`llmrun quantize`: a model in, a quantized HF checkpoint out.

Methods: "awq" (activation-aware INT4, `llmrun.awq`), "rtn" (round-to-nearest INT4, the same grouping) and
"int8" (symmetric per-channel 8-bit, round-to-nearest). INT4 checkpoints use AutoAWQ's GEMM layout
(quant_method "awq"), INT8 ones GPTQ's (quant_method "gptq", group_size -1, sym): the layouts transformers and
vLLM load. The embedding, norms and output head stay fp16, as AutoAWQ leaves them.

AWQ runs block by block: the calibration tokens' hidden states (samples x seq_len x dim, fp32) are the only
activations held for the whole model; each block's layer inputs are reduced on the fly to per-channel means and
a fixed random sample of `search_rows` token rows.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from llmrun.errors import LlmrunError, ModelFormatError, UsageError, parse_json

METHODS = ("awq", "rtn", "int8")
GROUP_SIZES = (128, 64, 32)  # the default is the first that divides every layer's input width
DEFAULT_CALIB = ("canterbury:lcet10", "canterbury:plrabn12", "canterbury:asyoulik")  # eval scores alice29


@dataclass(frozen=True)
class QuantizeOptions:
    method: str = "awq"
    group_size: int | None = None  # None: the largest of GROUP_SIZES that fits the model
    calib: str | None = None  # a text file or canterbury:NAME; None or canterbury: DEFAULT_CALIB
    samples: int = 128  # calibration windows
    seq_len: int | None = None  # tokens per window; None: 512, or the model's context if shorter
    search_rows: int = 4096  # token rows each layer's output error is measured on
    seed: int = 0


@dataclass
class QuantizeResult:
    out_dir: str
    method: str
    bits: int
    group_size: int  # -1: per output channel
    seconds: float
    peak_memory_bytes: int  # peak resident memory of the process (CPU) or allocated on the GPU
    calibration_tokens: int = 0
    # AWQ: per layer kind, the mean over blocks of the output error of AWQ's choice relative to plain RTN's
    awq_error_vs_rtn: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def choose_group_size(cfg, asked: int | None, blocks_of_32: bool = False) -> int:
    """`asked` if it is a multiple of 32 dividing every layer's input width; by default the largest of
    GROUP_SIZES that does, or 32 for a source stored in quantized blocks of 32 columns (`blocks_of_32`: GGUF's
    Q4_0, Q4_1, Q8_0, K-quants), whose weights already sit on one grid per 32 columns: a coarser group puts two or
    more of those grids under one scale, an error no scaling removes. Otherwise a message naming the sizes that fit."""
    inputs = sorted({width for width, _ in cfg.linear_widths().values()})
    fits = [g for g in GROUP_SIZES if all(w % g == 0 for w in inputs)]
    if asked is None and blocks_of_32 and 32 in fits:
        return 32
    if asked is None:
        if not fits:
            raise LlmrunError(f"no group size of {', '.join(map(str, GROUP_SIZES))} divides this model's input "
                              f"widths ({', '.join(map(str, inputs))}); it cannot be quantized group-wise")
        return fits[0]
    every = [g for g in range(min(inputs) // 32 * 32, 0, -32) if all(w % g == 0 for w in inputs)]
    sizes = ", ".join(map(str, every)) or "none"
    if asked <= 0 or asked % 32:
        raise UsageError(f"--group-size {asked}: it must be a positive multiple of 32; sizes that fit this model: {sizes}")
    if any(w % asked for w in inputs):
        bad = next(w for w in inputs if w % asked)
        raise UsageError(f"--group-size {asked} does not split this model's layers: it must be a multiple of 32 "
                          f"dividing every input width ({', '.join(map(str, inputs))}; {bad} is not); "
                          f"sizes that fit: {sizes}")
    return asked


def _check_source(files) -> None:
    if files.quant is not None:
        layout, bits, ours = files.quant.method, files.quant.bits, None
        if files.gguf is None:  # our own checkpoints say which method made them, as `llmrun models` shows
            try:
                ours = parse_json((files.source.path / "config.json").read_text()).get("llmrun", {}).get("method")
            except (OSError, ValueError, AttributeError):
                pass
        what = (f"{layout.upper()} INT{bits}" if not isinstance(ours, str) or ours == layout
                else f"INT8, in the {layout.upper()} layout" if ours == "int8"
                else f"{ours.upper()} INT{bits}, in the {layout.upper()} layout")
        raise LlmrunError(f"{files.source.spec} is already quantized ({what}); quantize the original float checkpoint"
                          " instead")
    if files.gguf is not None and "rope_freqs.weight" in files.gguf.tensors:
        raise LlmrunError(f"{files.source.spec} stores its RoPE scaling as a rope_freqs tensor, which config.json "
                          "cannot express; quantize the model's HF checkpoint instead")
    if files.gguf is not None:  # its config.json is written last: one it cannot express fails now, not then
        from llmrun.models import config_to_hf

        config_to_hf(files.config)
    for name, (_, outs) in files.config.linear_widths().items():
        if any(w % 8 for w in outs):
            raise LlmrunError(f"output widths {outs} of {name} are not multiples of 8, which AWQ/GPTQ packing needs")


def _stored_in_blocks(files) -> bool:
    """Whether the source is a GGUF with block-quantized tensors (every GGUF block format scales 32 columns or
    fewer at a time)."""
    return files.gguf is not None and any(t not in ("F32", "F16", "BF16") for t in files.stored_bytes)


def calibration_windows(tokenizer, text: str, samples: int, seq_len: int, seed: int):
    """-> (windows (S, seq_len) long, note or None): up to `samples` distinct non-overlapping windows of the
    text's tokens, chosen at random (seeded)."""
    import torch

    ids = tokenizer.encode(text)
    n = len(ids) // seq_len
    if n == 0:
        raise LlmrunError(f"the calibration text has {len(ids)} tokens, fewer than --seq-len {seq_len}; "
                          "give a longer --calib text or a smaller --seq-len")
    windows = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    pick = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:samples].sort().values
    note = None
    if n < samples:
        note = f"the calibration text holds {n} windows of {seq_len} tokens, fewer than --samples {samples}; using {n}"
    return windows[pick], note


def read_calibration(spec: str | None) -> str:
    """The text of `--calib SPEC`: a file, `canterbury:NAME`, or DEFAULT_CALIB (None, or a bare `canterbury`:
    the corpus less alice29, which eval scores)."""
    from llmrun.corpus import CORPUS
    from llmrun.eval import read_text

    return "\n\n".join(read_text(s) for s in (DEFAULT_CALIB if spec in (None, CORPUS) else (spec,)))


def quantize(spec, out_dir: str | Path, options: QuantizeOptions, device: str = "auto",
             on_progress: Callable[[int, int, str], None] | None = None) -> QuantizeResult:
    """Quantize model `spec` (MODEL, or a resolved `loading.ModelSource`) into the new directory `out_dir`.
    `on_progress(done, total, what)` is called as the weights are read (tensors), then as the blocks are done.
    The directory appears whole or not at all."""
    import torch

    from llmrun.loading import file_names, load_weights, open_model, resolve_device

    if options.method not in METHODS:
        raise LlmrunError(f"unknown method {options.method!r}; choose one of {', '.join(METHODS)}")
    out_dir = Path(out_dir)
    try:
        os.stat(out_dir)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LlmrunError(f"-o {out_dir}: its symbolic links go round in a loop") from None
    if out_dir.is_symlink():  # the checkpoint goes where the link points (made there if missing), the link leads to it
        out_dir = Path(os.path.realpath(out_dir))
    if ".." in out_dir.parts:  # DIR/.. names DIR's parent, made or not: its name and parent are those of the path
        out_dir = Path(os.path.abspath(out_dir))
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise LlmrunError(f"{out_dir} exists and is not an empty directory; choose another -o or remove it")
    _check_writable(out_dir)  # before the work, not after it
    t0 = time.perf_counter()
    files = open_model(spec)
    _check_source(files)
    cfg = files.config
    bits = 8 if options.method == "int8" else 4
    if options.method == "int8":
        if options.group_size is not None:
            raise UsageError("--int8 quantizes per output channel; --group-size applies to --awq and --rtn")
        group = -1
    else:
        group = choose_group_size(cfg, options.group_size, blocks_of_32=_stored_in_blocks(files))
    result = QuantizeResult(str(out_dir), options.method, bits, group, 0.0, 0)
    windows = None
    if options.method == "awq":
        if options.seq_len is None:
            options = replace(options, seq_len=min(512, cfg.max_seq_len))
        elif options.seq_len > cfg.max_seq_len:
            raise UsageError(f"--seq-len {options.seq_len} exceeds the model's context of {cfg.max_seq_len} tokens")
        windows, note = calibration_windows(files.tokenizer, read_calibration(options.calib), options.samples,
                                            options.seq_len, options.seed)
        result.calibration_tokens = windows.numel()
        options = replace(options, samples=windows.shape[0], seq_len=windows.shape[1])  # what config.json records
        result.notes += [note] if note else []
    if _stored_in_blocks(files):
        result.notes.append(f"{files.source.spec} is stored quantized ({', '.join(sorted(files.stored_bytes))}); its "
                            "weights are dequantized first, so the result carries both roundings")
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    reading = (lambda done, total, name: on_progress(done, total, "reading weights")) if on_progress else None
    loaded = load_weights(files, device="cpu", dtype="fp32", weights="dequant", on_progress=reading)
    model = loaded.model
    corrupt = next((name for name, t in model.state_dict().items() if not torch.isfinite(t).all()), None)
    if corrupt is not None:  # quantized, it would make a checkpoint that cannot answer either
        names = file_names(files, corrupt)
        raise ModelFormatError(f"{files.source.path}: {' or '.join(names)} hold{'s' * (len(names) == 1)} NaN or inf "
                               "values: its weights are corrupt")
    tensors = {}
    with torch.no_grad():
        if windows is not None:
            result.awq_error_vs_rtn = _run_awq(model, windows, bits, group, options, dev, tensors, on_progress)
        else:
            for i, block in enumerate(model.layers):
                if on_progress:
                    on_progress(i, cfg.n_layers, f"block {i}")
                _quantize_block(block, i, cfg, bits, group, tensors)
            if on_progress:
                on_progress(cfg.n_layers, cfg.n_layers, "done")
        tensors.update(_float_tensors(model))
    overflowed = next((name for name, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if overflowed is not None:  # written, it was a checkpoint every load refuses
        raise LlmrunError(f"{files.source.spec}: {overflowed} does not fit in fp16, which AWQ/GPTQ checkpoints store "
                          "scales, norms and embeddings in (values past 65504 become inf); this model cannot be "
                          "quantized to them")
    _write(files, tensors, out_dir, _quantization_config(options.method, bits, group), options)
    result.seconds = time.perf_counter() - t0
    result.peak_memory_bytes = (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda"
                                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return result


def _run_awq(model, windows, bits, group, options, dev, tensors, on_progress) -> dict[str, float]:
    import torch

    from llmrun.awq import awq_block

    cfg = model.config
    hidden = model.embed(windows).float().to(dev)  # (S, T, dim)
    cos, sin = (t[: windows.shape[1]].to(dev) for t in model._rope_tables(windows.shape[1], dev))
    gen = torch.Generator().manual_seed(options.seed)
    ratios: dict[str, list[float]] = {}
    for i, block in enumerate(model.layers):
        if on_progress:
            on_progress(i, cfg.n_layers, f"block {i}: calibrating")
        for p in block.parameters():  # own copies: float GGUF tensors are views of the read-only file mapping
            p.data = p.data.to(dev, copy=True)
        inputs, hidden = capture_inputs(block, hidden, cos, sin, cfg.layer_window(i), options.search_rows, gen)
        if on_progress:
            on_progress(i, cfg.n_layers, f"block {i}: searching scales")
        quantized, report = awq_block(block, inputs, cfg, bits, group)
        for name in report.awq:
            ratios.setdefault(name, []).append(report.awq[name] / max(report.rtn[name], 1e-30))
        _quantize_block(block, i, cfg, bits, group, tensors, quantized)
        block.to("cpu")
        del inputs
    if on_progress:
        on_progress(cfg.n_layers, cfg.n_layers, "done")
    return {name: sum(r) / len(r) for name, r in ratios.items()}


def capture_inputs(block, hidden, cos, sin, window, search_rows: int, gen, chunk: int = 4):
    """Run `block` over hidden (S, T, dim) a few windows at a time -> ({layer: LinearInputs}, the block's output).
    Forward pre-hooks on the four linear layers reduce their inputs as they pass."""
    import torch

    from llmrun.awq import LinearInputs

    S, T, _ = hidden.shape
    picked = torch.randperm(S * T, generator=gen)[:search_rows].sort().values.to(hidden.device)
    taps = {"qkv": block.attn.qkv, "o": block.attn.o, "gate_up": block.mlp.gate_up, "down": block.mlp.down}
    sums, squares, rows = {}, {}, {name: [] for name in taps}
    first = [0]  # flat index of the chunk's first token

    def tap(name):
        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()  # (tokens, in)
            sums[name] = sums.get(name, 0) + x.abs().sum(0)
            squares[name] = squares.get(name, 0) + x.pow(2).sum(0)
            here = picked[(picked >= first[0]) & (picked < first[0] + x.shape[0])] - first[0]
            rows[name].append(x[here])
        return hook

    handles = [layer.register_forward_pre_hook(tap(name)) for name, layer in taps.items()]
    out = torch.empty_like(hidden)
    try:
        for start in range(0, S, chunk):
            first[0] = start * T
            out[start : start + chunk] = block(hidden[start : start + chunk], cos, sin, 0, None, window)
    finally:
        for handle in handles:
            handle.remove()
    n = S * T
    return {name: LinearInputs(sums[name] / n, squares[name] / n, torch.cat(rows[name])) for name in taps}, out


def _quantize_block(block, i: int, cfg, bits: int, group: int, tensors: dict, quantized: dict | None = None) -> None:
    """Quantize the block's four (fused) linear layers into `tensors` under HF names, split into their parts;
    `quantized` holds layers already quantized (AWQ's), by module name."""
    from llmrun.awq import quantize_groups, quantize_int8_rows
    from llmrun.loading import fused_parts, hf_tensor_name
    from llmrun.quant_formats import pack_awq, pack_gptq

    pack = pack_gptq if bits == 8 else pack_awq
    for ours, (_, widths) in cfg.linear_widths().items():
        linear = block.get_submodule(ours)
        w = linear.weight.float().cpu()
        if quantized is not None:
            q = quantized[ours]
            q = replace(q, codes=q.codes.cpu(), scales=q.scales.cpu(), zeros=q.zeros.cpu())
        else:
            q = quantize_int8_rows(w) if bits == 8 else quantize_groups(w, bits, group)
        start = 0
        for part, width in zip(fused_parts(ours), widths):
            module = hf_tensor_name(f"layers.{i}.{part}.weight").removesuffix(".weight")
            for suffix, t in pack(q.rows(start, start + width)).items():
                tensors[f"{module}.{suffix}"] = t.contiguous()
            if linear.bias is not None:
                tensors[f"{module}.bias"] = linear.bias[start : start + width].half().cpu().contiguous()
            start += width


def _float_tensors(model) -> dict:
    """The tensors that stay float (fp16): embedding, norms (AWQ's scales folded in; Qwen3's per-head q/k norms
    too), output head."""
    from llmrun.loading import hf_tensor_name

    names = ["embed.weight", "norm.weight", *(["lm_head.weight"] if model.lm_head is not None else [])]
    names += [name for name, _ in model.layers.named_parameters("layers") if name.endswith("norm.weight")]
    return {hf_tensor_name(name): model.get_parameter(name).detach().half().cpu().contiguous() for name in names}


def _quantization_config(method: str, bits: int, group: int) -> dict:
    if method == "int8":
        return {"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True, "desc_act": False,
                "checkpoint_format": "gptq"}
    return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def _check_writable(out_dir: Path) -> None:
    """`_write` will be able to make `out_dir` (or fill it, an empty directory), judged without making anything: a
    temporary directory in it, or in the nearest of its parents that exists."""
    blocking = next((p for p in out_dir.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise LlmrunError(f"-o {out_dir}: {blocking} is a file, not a directory")
    existing = next(p for p in (out_dir, *out_dir.parents) if p.exists())
    try:
        tempfile.TemporaryDirectory(prefix=".llmrun-quantize.", dir=existing).cleanup()
    except OSError as e:
        raise LlmrunError(f"-o {out_dir}: cannot write there ({e.strerror or e})") from None


def _write(files, tensors: dict, out_dir: Path, quantization_config: dict, options: QuantizeOptions) -> None:
    """config.json, model.safetensors and the tokenizer files, into `out_dir`."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from llmrun.models import config_to_hf

    # An empty directory (checked before the work) is filled in place: it may be `.`, a mount point, or have an
    # owner and modes of its own. Else the checkpoint is made beside it and renamed into place, whole or not at all.
    in_place = out_dir.is_dir()
    if not in_place:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".llmrun-quantize." if in_place else f".{out_dir.name}.",
                                dir=out_dir if in_place else out_dir.parent))
    moved = []
    try:
        if files.gguf is None:  # keep every field of the original config and its tokenizer files as they are
            config = parse_json((files.source.path / "config.json").read_text())
            for path in files.source.path.iterdir():
                if path.is_file() and (path.name.startswith(("tokenizer", "special_tokens", "generation_config",
                                                             "added_tokens", "chat_template", "vocab", "merges"))):
                    shutil.copy2(path, tmp / path.name)
        else:
            config = config_to_hf(files.config)
            tok = files.tokenizer
            config.update({"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id})
            tok.save(tmp)
        config["torch_dtype"] = "float16"
        if "dtype" in config:  # transformers >= 5 writes and reads this name
            config["dtype"] = "float16"
        config["quantization_config"] = quantization_config
        config["llmrun"] = {"quantized_from": str(files.source.spec), "method": options.method,
                            **({"calibration": options.calib or "+".join(DEFAULT_CALIB), "samples": options.samples,
                                "seq_len": options.seq_len, "seed": options.seed} if options.method == "awq" else {})}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        for path in (tmp, *tmp.iterdir()):  # mkdtemp made the directory private; give it the usual modes
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
        if not in_place:
            os.replace(tmp, out_dir)
            return
        if any(path != tmp for path in out_dir.iterdir()):
            raise LlmrunError(f"-o {out_dir}: files appeared in it while quantizing; the checkpoint was not written")
        for path in sorted(tmp.iterdir()):
            os.replace(path, out_dir / path.name)
            moved.append(out_dir / path.name)
        tmp.rmdir()
    except OSError as e:  # a disk that filled up, say
        _remove(tmp, moved)
        raise LlmrunError(f"-o {out_dir}: writing failed ({e.strerror or e})") from None
    except SafetensorError as e:  # safetensors' own write: its OSError as a message ("No space left on device")
        _remove(tmp, moved)
        reason = str(e).removeprefix("Error while serializing: ").split(" (os error")[0]
        raise LlmrunError(f"-o {out_dir}: writing failed ({reason})") from None
    except BaseException:
        _remove(tmp, moved)
        raise


def _remove(tmp: Path, moved: list[Path]) -> None:
    """What a failed `_write` made: its temporary directory and the files it had moved into place."""
    shutil.rmtree(tmp, ignore_errors=True)
    for path in moved:
        path.unlink(missing_ok=True)
