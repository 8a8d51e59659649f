"""`llmrun info`: what a model is, read from its files without loading the weights."""

import json

from rich.table import Table
from rich.text import Text

from llmrun.loading import DEFAULT_MODEL, stores_a_tied_head

from . import app
from .console import err, open_files, user_errors, write_out
from .options import JsonFlag, ModelArg


@app.command()
@user_errors
def info(model: ModelArg = DEFAULT_MODEL, json_out: JsonFlag = False):
    """Architecture, parameters, weight bytes by dtype, context, KV bytes per token, tokenizer and template."""
    from llmrun.kernels import ref
    from llmrun.kv_cache import KV_FORMATS, int4_ring_bytes, int4_ring_slots, unsupported
    from llmrun.kv_cache import bytes_per_token as kv_bytes
    from llmrun.memory import human_bytes

    files = open_files(model)
    cfg, tok = files.config, files.tokenizer
    if stores_a_tied_head(files):  # (told before the table: what follows is config.json's)
        err.print(Text("warning: config.json ties the output head to the embedding, but the checkpoint stores "
                       "lm_head.weight too: loading uses it where it differs from the embedding (then not tied, "
                       "one more matrix than the parameters below count)", style="yellow"))
    ctx = cfg.max_seq_len  # an INT4 cache of the whole context: a shorter one (--ctx) may have shorter rings
    doc = {
        "model": model,
        "path": str(files.source.path),
        "format": files.source.format,
        "architecture": cfg.architecture,
        "parameters": cfg.n_params,
        "weight_bytes": dict(sorted(files.stored_bytes.items())),
        "layers": cfg.n_layers,
        "dim": cfg.dim,
        "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "ffn_dim": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size,
        "context_length": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling.kind if cfg.rope_scaling else None,
        # (YaRN's: the context_length above is this factor times the trained one)
        "rope_scaling_factor": cfg.rope_scaling.factor if cfg.rope_scaling else None,
        "qk_norm": cfg.qk_norm,
        "sliding_window": cfg.sliding_window,
        "sliding_window_from_layer": cfg.sliding_window_from if cfg.sliding_window else None,
        "tied_embeddings": cfg.tie_embeddings,
        # (null: a format this model's heads cannot be kept in)
        "kv_bytes_per_token": {fmt: None if unsupported(cfg, fmt) else kv_bytes(cfg, fmt) for fmt in KV_FORMATS},
        "kv_int4_rings": None if unsupported(cfg, "int4") else {
            "positions": ref.ring_window(int4_ring_slots(ctx)), "slots": int4_ring_slots(ctx),
            "bf16": int4_ring_bytes(cfg, 2, ctx), "fp32": int4_ring_bytes(cfg, 4, ctx)},
        "tokenizer": tok.kind,
        "chat_template": tok.chat_template is not None,
    }
    if json_out:
        write_out(json.dumps(doc) + "\n")
        return
    table = Table(title=f"{model}", show_header=False)
    for key, value in doc.items():
        if key == "weight_bytes":
            value = ", ".join(f"{k} {human_bytes(v)}" for k, v in value.items()) + f" (total {human_bytes(sum(value.values()))})"
        elif key == "kv_bytes_per_token":
            value = ", ".join(f"{k} {'n/a (head size)' if v is None else human_bytes(v)}" for k, v in value.items())
        elif key == "kv_int4_rings" and value is None:
            value = "n/a (head size)"
        elif key == "kv_int4_rings":
            value = (f"the last {value['positions']} positions' exact keys and values, in {value['slots']} slots: "
                     f"{human_bytes(value['bf16'])} in bf16, {human_bytes(value['fp32'])} in fp32 (fixed)")
        elif key == "parameters":
            value = f"{value:,} ({value / 1e6:.1f} M)"
        table.add_row(key.replace("_", " "), str(value))
    err.print(table)
