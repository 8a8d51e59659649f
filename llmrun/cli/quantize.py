"""`llmrun quantize`: AWQ or round-to-nearest INT4 and INT8 checkpoints that transformers and vLLM load too."""

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmrun.errors import UsageError
from llmrun.loading import DEFAULT_MODEL

from . import app
from .console import err, model_source, progress_bar, user_errors, write_out
from .options import MAX_THREADS, Device, JsonFlag, ModelArg

METHOD = "Method"
CALIBRATION = "Calibration (--awq)"


def _record(out_dir: str) -> None:
    """Note the checkpoint in llmrun's index, for `llmrun models`; a cache that cannot be written costs a warning."""
    from llmrun.catalog import record_quantized

    try:
        record_quantized(out_dir)
    except OSError as e:
        err.print(f"warning: {out_dir} is not listed by `llmrun models`: cannot write its index ({e.strerror or e})")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@app.command("quantize")
@user_errors
def quantize_(
    model: ModelArg = DEFAULT_MODEL,
    *,
    out: Annotated[str, typer.Option("--out", "-o", metavar="DIR", help="The checkpoint directory to create (must not exist, or be empty).", show_default=False)],
    awq: Annotated[bool, typer.Option("--awq", help="Activation-aware INT4 (the default): scales searched on calibration text, then clipping.", rich_help_panel=METHOD)] = False,
    rtn: Annotated[bool, typer.Option("--rtn", help="Round-to-nearest INT4, the same grouping: the baseline AWQ improves on.", rich_help_panel=METHOD)] = False,
    int8: Annotated[bool, typer.Option("--int8", help="Round-to-nearest symmetric INT8 per output channel (GPTQ layout).", rich_help_panel=METHOD)] = False,
    bits: Annotated[Optional[int], typer.Option(help="Weight bits: 4 with --awq/--rtn, 8 with --int8.", rich_help_panel=METHOD, show_default=False)] = None,
    group_size: Annotated[Optional[int], typer.Option(help="Input columns per scale and zero point, a multiple of 32 dividing every layer (default: 128, or the largest of 64, 32 that fits).", rich_help_panel=METHOD, show_default=False)] = None,
    calib: Annotated[Optional[str], typer.Option(metavar="FILE|canterbury[:NAME]", help="Calibration text (default, or a bare canterbury: the Canterbury corpus's lcet10, plrabn12 and asyoulik; alice29, which eval scores, is left out).", rich_help_panel=CALIBRATION, show_default=False)] = None,
    samples: Annotated[Optional[int], typer.Option(min=1, help="Calibration windows (default: 128).", rich_help_panel=CALIBRATION, show_default=False)] = None,
    seq_len: Annotated[Optional[int], typer.Option(min=16, help="Tokens per calibration window (default: 512, or the model's context if shorter).", rich_help_panel=CALIBRATION, show_default=False)] = None,
    seed: Annotated[Optional[int], typer.Option(min=0, max=2**64 - 1, help="Seed of the calibration windows and sampled rows (default: 0).", rich_help_panel=CALIBRATION, show_default=False)] = None,
    device: Annotated[Device, typer.Option(help="Where AWQ's search runs: cuda when available, else cpu.")] = Device.auto,
    threads: Annotated[Optional[int], typer.Option(min=1, max=MAX_THREADS, help="CPU threads (default: one per core).", show_default=False)] = None,
    json_out: JsonFlag = False,
):
    """Quantize a model into an HF checkpoint: INT4 in AutoAWQ's GEMM layout (--awq, --rtn) or INT8 in GPTQ's (--int8), with config.json and the tokenizer files, loadable by llmrun, transformers and vLLM.

    Runs block by block, holding only the calibration tokens' hidden states; slow on a CPU (minutes for the embedded model), fast on a GPU.
    """
    from llmrun.quantize import QuantizeOptions, quantize

    if not out.strip():  # (as a Path, "" would be ".")
        raise typer.BadParameter("is empty; give the directory to create", param_hint="'--out' / '-o'")
    if awq + rtn + int8 > 1:
        raise UsageError("choose one of --awq, --rtn and --int8")
    method = "rtn" if rtn else "int8" if int8 else "awq"
    if bits is not None and bits != (8 if int8 else 4):
        raise UsageError(f"--bits {bits}: --int8 writes 8-bit weights" if int8 else
                          f"--bits {bits}: --{method} writes 4-bit weights (AWQ's layout); for 8 bits use --int8")
    calibration = {"--calib": calib, "--samples": samples, "--seq-len": seq_len, "--seed": seed}
    given = [flag for flag, value in calibration.items() if value is not None]
    if method != "awq" and given:
        raise UsageError(f"{', '.join(given)}: calibration applies to --awq only")
    if threads:
        from llmrun import threads as pool

        pool.set_threads(threads)
    options = QuantizeOptions(method, group_size, calib, samples or 128, seq_len, seed=seed or 0)

    source = model_source(model)  # a hub download first, with its own bar
    with progress_bar(f"quantize {model} ({method.upper()})") as update:
        result = quantize(source, Path(out), options, device=device.value, on_progress=update)

    _record(result.out_dir)
    for note in result.notes:
        err.print(f"note: {note}")
    stored = sum(f.stat().st_size for f in Path(result.out_dir).glob("*.safetensors"))
    grouping = "per channel" if result.group_size == -1 else f"group {result.group_size}"
    kind = "INT8" if method == "int8" else f"{method.upper()} INT{result.bits}"
    err.print(f"wrote {result.out_dir}: {kind}, {grouping} · {_mib(stored)} of weights · "
              f"{result.seconds:.1f} s · peak memory {_mib(result.peak_memory_bytes)}")
    if result.awq_error_vs_rtn:
        ratios = ", ".join(f"{name} {ratio:.2f}" for name, ratio in result.awq_error_vs_rtn.items())
        err.print(f"layer output error vs round-to-nearest (mean over blocks): {ratios}")
    if json_out:
        write_out(json.dumps(result.to_json()) + "\n")
