"""Markdown rows for bench/RESULTS.md from saved `llmrun bench --json` documents, so no figure is typed by hand.

    python bench/results_tables.py bench/runs/2026-11-21-cpu2-*.json
"""

import json
import sys
from pathlib import Path


def mib(n):
    return f"{n / 2**20:.0f} MiB" if n is not None else "–"


def header(*columns):
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


def main(paths):
    for path in map(Path, paths):
        doc = json.loads(path.read_text())
        if "workload" not in doc:  # an eval document
            continue
        w, c, dec = doc["workload"], doc["config"], doc["decode_tok_s"]
        where = f"`{path.as_posix()}`"
        if doc.get("compare"):
            print(f"\n{where}: {w['kind']}, {w['prompt_tokens']} + {w['new_tokens']} tokens, {c['threads']} threads, "
                  f"median of {w['repeat']}\n")
            header("engine", "config", "TTFT ms", "prefill tok/s", "decode tok/s", "decode ratio", "prefill ratio")
            for row in doc["compare"]:
                if row.get("skipped"):
                    print(f"| {row['name']} | {row['skipped']} | | | | | |")
                    continue
                d = row["decode_tok_s"]
                d = d["median"] if isinstance(d, dict) else d
                print(f"| {row['name']} {row['version']} | {row['config']} | {row['ttft_s'] * 1000:.0f} | "
                      f"{row['prefill_tok_s']:.0f} | {d:.1f} | {row['decode_ratio']:.2f} | {row['prefill_ratio']:.2f} |")
        elif doc.get("sweep"):
            print(f"\n{where}: {w['kind']}, {w['prompt_tokens']} + {w['new_tokens']} tokens\n")
            header("rank", "flags", "decode tok/s", "TTFT ms", "peak RSS", "KL to fp32", "top-1")
            for row in doc["sweep"]:
                if row.get("error"):
                    print(f"| – | `{row['flags']}` | {row['error']} | | | | |")
                    continue
                kl = "–" if row.get("kl") is None else f"{row['kl']:.4f}"
                top1 = "–" if row.get("top1_agreement") is None else f"{row['top1_agreement']:.1%}"
                print(f"| {row['rank']} | `{row['flags'] or '(defaults)'}` | {row['decode_tok_s']['median']:.1f} | "
                      f"{row['ttft_s'] * 1000:.0f} | {mib(row['memory']['process_peak_rss'])} | {kl} | {top1} |")
            print(f"\nrecommended for {doc['recommended']['goal']}: `{doc['recommended']['flags']}`")
        else:
            # the KV cache's format and eviction where not the defaults; on a GPU its peak allocation, else the RSS
            kv = "".join(f" --{flag.replace('_', '-')} {c[flag]}" for flag, default in
                         (("kv", "auto"), ("kv_evict", None), ("kv_budget", None)) if c.get(flag, default) != default)
            mem = doc["memory"]
            peak = (f"{mib(mem['device_peak_allocated'])} GPU" if mem.get("device_peak_allocated")
                    else mib(mem["process_peak_rss"]))
            print(f"| {doc['model']} | {w['kind']}, {w['prompt_tokens']} + {w['new_tokens']} | {c['dtype']} "
                  f"`--weights {c['weights']}{kv}` ({doc['weights_loaded']}) | {doc['ttft_s'] * 1000:.0f} | "
                  f"{doc['prefill_tok_s']:.0f} | {dec['median']:.1f} ({dec['min']:.1f}–{dec['max']:.1f}) | "
                  f"{peak} | {doc['bandwidth_gb_s']:.1f} GB/s "
                  f"({doc['bandwidth_share']:.0%}) | {where} |")


if __name__ == "__main__":
    main(sys.argv[1:])
