"""What a compressed or bounded KV cache costs in quality: perplexity and KL against the full-precision cache on
long English text, and a long-context retrieval check, per KV configuration.

    python bench/kv_quality.py [--model smollm2] [--ctx 2048 8192] [--tokens 8192] [--weights dequant] [--out FILE.json]

Perplexity: `llmrun eval`'s sliding windows (stride ctx/2) over the Canterbury corpus's alice29 (the first
--tokens tokens), every logit through the KV cache as chat computes it; KL(full || config) and top-1 agreement
against the model's own full-precision cache (fp32 on CPU), whose log-probabilities are computed once per
window and shared by every configuration. Budgets are fractions of the window: `h2o:25%` keeps a quarter of it.

The model runs with its weights dequantized to fp32 (`--weights dequant`, plain-PyTorch matmuls) so that only the
KV cache differs between configurations: llmrun's packed-weight kernels round activations to int8 per block of 32,
which turns any change of the attention's last bits into a change of the next matmul's input — merely reordering
fp32 attention sums costs KL 0.0033 on that path, about what an int8 cache does. `--weights auto` measures the
packed path anyway.

Retrieval: a passphrase planted near the start of a long prompt (the rest is Canterbury text, ctx - 200 tokens
in all), asked for at the end; greedy, and a hit when the reply contains it. Three passphrases per context.

Writes the JSON to --out (default bench/runs/DATE-cpuTHREADS-kv-quality.json) and the Markdown table beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from llmrun.eval import read_text, sliding_windows
from llmrun.generate import Engine
from llmrun.kv_cache import Eviction
from llmrun.loading import load_model
from llmrun.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
CONFIGS = ["bf16", "fp16", "int8", "int4", "window:50%", "window:25%", "h2o:50%", "h2o:25%", "int4+h2o:50%"]
SECRETS = ["violet-harbor-7316", "copper-lantern-2048", "quiet-meadow-5591"]


def engine_for(loaded, config: str | None, ctx: int) -> Engine:
    fmt, eviction = None, None
    if config:
        for part in config.split("+"):
            if ":" in part:
                policy, share = part.split(":")
                eviction = Eviction(policy, ctx * int(share.rstrip("%")) // 100, 4)
            else:
                fmt = part
    return Engine(loaded, ctx, kv_format=fmt, eviction=eviction)


def window_logp(engine, ids, window):
    """Log-probabilities (T, V) of the window's rows, fed in the engine's prefill chunks."""
    engine.reset()
    rows = []
    for pos in range(window.start, window.end, engine.prefill_chunk):
        rows.append(engine.forward(ids[pos : min(pos + engine.prefill_chunk, window.end)], last_only=False).float())
    return torch.cat(rows).log_softmax(-1)


def quality(loaded, ids, ctx, configs):
    windows = sliding_windows(len(ids), ctx, ctx // 2)
    targets = torch.tensor(ids)
    reference = engine_for(loaded, None, ctx)
    sums = {c: {"nll": [], "kl": [], "top1": []} for c in [None, *configs]}
    for w in windows:
        skip = w.first_scored - 1 - w.start  # rows this window scores
        ref_logp = window_logp(reference, ids, w)[skip:]
        y = targets[w.first_scored : w.end + 1]
        sums[None]["nll"].append(-ref_logp.gather(1, y[:, None])[:, 0])
        for c in configs:
            t0 = time.perf_counter()
            logp = window_logp(engine_for(loaded, c, ctx), ids, w)[skip:]
            sums[c]["nll"].append(-logp.gather(1, y[:, None])[:, 0])
            sums[c]["kl"].append((ref_logp.exp() * (ref_logp - logp)).sum(-1))
            sums[c]["top1"].append(ref_logp.argmax(-1) == logp.argmax(-1))
            print(f"  ctx {ctx} window {w.start}: {c} {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    base = math.exp(torch.cat(sums[None]["nll"]).double().mean().item())
    out = {"full": {"ppl": base}}
    for c in configs:
        ppl = math.exp(torch.cat(sums[c]["nll"]).double().mean().item())
        out[c] = {"ppl": ppl, "ppl_delta_pct": 100 * (ppl / base - 1), "kl_mean": torch.cat(sums[c]["kl"]).double().mean().item(),
                  "top1_agreement": torch.cat(sums[c]["top1"]).double().mean().item()}
    return out, len(windows)


def retrieval(loaded, filler_ids, ctx, configs):
    tok = loaded.tokenizer
    out = {}
    for c in [None, *configs]:
        hits = 0
        for i, secret in enumerate(SECRETS):
            fact = f"Remember this: the secret passphrase is {secret}.\n\n"
            question = "\n\nWhat is the secret passphrase? Answer with the passphrase only."
            head = tok.encode(fact)
            tail = tok.encode(question)
            body = filler_ids[i * 997 : i * 997 + ctx - 200 - len(head) - len(tail)]
            text = tok.decode(tok.encode("Read this text.\n\n") + head + body + tail)
            prompt = tok.encode_chat([{"role": "user", "content": text}])
            engine = engine_for(loaded, c, ctx)
            g = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24))
            reply = "".join(g)
            hits += secret in reply
        out[c or "full"] = {"hits": hits, "of": len(SECRETS)}
        print(f"  retrieval ctx {ctx}: {c or 'full'} {hits}/{len(SECRETS)}", file=sys.stderr, flush=True)
    return out


def table(doc) -> str:
    lines = []
    for ctx, r in doc["results"].items():
        lines.append(f"\n### context {ctx}, weights {doc.get('weights', 'auto')} ({r['windows']} windows, {r['scored']} tokens scored; retrieval: "
                     f"passphrase found in n of {len(SECRETS)})\n")
        lines.append("| KV cache | ppl | Δ ppl | KL vs full | top-1 agree | retrieval |")
        lines.append("|---|---|---|---|---|---|")
        full = r["quality"]["full"]
        lines.append(f"| full ({doc['full_precision']}) | {full['ppl']:.4f} | | | | {r['retrieval']['full']['hits']}/{len(SECRETS)} |")
        for c in doc["configs"]:
            q, ret = r["quality"][c], r["retrieval"][c]
            lines.append(f"| {c} | {q['ppl']:.4f} | {q['ppl_delta_pct']:+.2f}% | {q['kl_mean']:.4f} | "
                         f"{100 * q['top1_agreement']:.1f}% | {ret['hits']}/{len(SECRETS)} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--tokens", type=int, default=8192, help="text tokens scored per context (at least 1.5 windows)")
    ap.add_argument("--configs", nargs="+", default=CONFIGS)
    ap.add_argument("--weights", default="dequant", help="weight mode, as llmrun's --weights (default: dequant)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, weights=args.weights)
    ids = loaded.tokenizer.encode(read_text("canterbury:alice29"))
    filler = loaded.tokenizer.encode(read_text("canterbury:lcet10"))
    doc = {"model": args.model, "device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__,
           "full_precision": str(loaded.dtype).removeprefix("torch."), "weights": loaded.weights, "configs": args.configs,
           "commit": os.popen("git rev-parse --short HEAD").read().strip(),
           "command": "python " + " ".join(sys.argv), "results": {}}
    for ctx in args.ctx:
        text = ids[: max(args.tokens, ctx + ctx // 2) + 1]
        q, n_windows = quality(loaded, text, ctx, args.configs)
        doc["results"][ctx] = {"windows": n_windows, "scored": len(text) - 1, "quality": q,
                               "retrieval": retrieval(loaded, filler, ctx, args.configs)}
    stamp = datetime.date.today().isoformat()
    out = args.out or HERE / "runs" / f"{stamp}-cpu{doc['threads']}-kv-quality.json"
    out.write_text(json.dumps(doc, indent=1))
    md = table(doc)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
