"""Structured output on CPU: JSON extraction with and without a schema, with and without jump-forward.

    python bench/structured.py [--model smollm2] [--repeat 3] [--threads 2] [--new-tokens 160] [--out FILE.json]

Each task is a short document and a schema for the facts in it; the same chat prompt (asking for those facts as
JSON) runs greedy three ways on one engine, runs alternating, after a warm-up of each:
- free: no constraint (whether the reply even parses is recorded);
- schema: the schema's grammar masks every token (`--json-schema FILE --no-jump-forward`);
- schema + jump-forward: text the grammar forces is proposed and verified in one forward (`--json-schema FILE`).

Reported per task and way (medians): decode tok/s (tokens after the first / the time they took), the whole
reply's time, tokens forced and sampled, target forwards, the grammar's cost per token in microseconds (masks,
accepting tokens, jump-forward lookups), and whether the reply validates. Writes the JSON to --out (default
bench/runs/DATE-cpuTHREADS-structured.json) and the Markdown table beside it; prints the table.
Timings mean something only on a quiet machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from llmrun import bench
from llmrun.generate import Engine
from llmrun.grammar import compile_grammar, grammar_spec
from llmrun.loading import load_model
from llmrun.sampling import SamplingParams

HERE = Path(__file__).resolve().parent

TASKS = {
    "order": (
        "Order 4417 was placed on 2026-03-02 by Dana Whitfield (dana.whitfield@example.org). She bought two "
        "ceramic mugs at 12.50 each and one teapot at 34.00, shipped to Leeds. The order has been paid.",
        {"type": "object", "properties": {
            "order_id": {"type": "integer"}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                          "email": {"type": "string", "maxLength": 60}},
                         "required": ["name", "email"], "additionalProperties": False},
            "items": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
                "product": {"type": "string", "maxLength": 30}, "quantity": {"type": "integer"},
                "unit_price": {"type": "number"}}, "required": ["product", "quantity", "unit_price"],
                "additionalProperties": False}},
            "city": {"type": "string", "maxLength": 30}, "paid": {"type": "boolean"}},
         "required": ["order_id", "date", "customer", "items", "city", "paid"], "additionalProperties": False},
    ),
    "ticket": (
        "Ticket from Arjun Mehta, 9 May: the mobile app crashes every time he opens the settings page on his "
        "Pixel 8 running Android 15. He has reinstalled twice. He needs it fixed before Friday's demo.",
        {"type": "object", "properties": {
            "reporter": {"type": "string", "maxLength": 40},
            "product": {"enum": ["mobile app", "web app", "desktop app", "api"]},
            "severity": {"enum": ["low", "medium", "high", "critical"]},
            "device": {"type": "string", "maxLength": 30}, "os_version": {"type": "string", "maxLength": 20},
            "steps_tried": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
            "deadline": {"type": "string", "maxLength": 20}},
         "required": ["reporter", "product", "severity", "device", "os_version", "steps_tried", "deadline"],
         "additionalProperties": False},
    ),
    "person": (
        "Marguerite Okafor, 47, is a marine biologist based in Lisbon. She speaks Portuguese, English and French, "
        "and has led four research expeditions to the Azores.",
        {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
            "occupation": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 30},
            "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
            "expeditions": {"type": "integer"}},
         "required": ["name", "age", "occupation", "city", "languages", "expeditions"], "additionalProperties": False},
    ),
}
WAYS = ("free", "schema", "schema+jump-forward")


def prompt_for(document: str, schema: dict) -> str:
    keys = ", ".join(schema["properties"])
    return f"{document}\n\nExtract the facts above as one JSON object with the keys {keys}. Reply with the JSON only."


def validates(text: str, schema: dict) -> bool:
    """Parses, and has exactly the schema's required top-level keys (a cheap check that needs no validator)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(doc, dict) and set(doc) == set(schema["required"])


def run(engine: Engine, ids: list[int], params: SamplingParams) -> tuple[dict, str]:
    engine.reset()
    reply = engine.generate(ids, params)
    text = "".join(reply)
    return reply.stats.as_dict() | {"reply_s": round(reply.stats.ttft_s + reply.stats.decode_s, 4)}, text


def measure(engine: Engine, task: str, args) -> list[dict]:
    document, schema = TASKS[task]
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt_for(document, schema)}])
    spec = grammar_spec(json_schema=json.dumps(schema))
    grammars = {"free": None,
                "schema": compile_grammar(spec, engine.tokenizer, engine.model.config.vocab_size, jump_forward=False),
                "schema+jump-forward": compile_grammar(spec, engine.tokenizer, engine.model.config.vocab_size)}
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    texts = {}
    for i in range(args.repeat + 1):  # the first round warms up
        for way in WAYS:
            engine.grammar = grammars[way]
            stats, texts[way] = run(engine, ids, params)
            if i:
                runs[way].append(stats)
    engine.grammar = None
    rows = []
    for way in WAYS:
        last = runs[way][-1]
        med = {key: statistics.median(r[key] for r in runs[way]) for key in ("decode_tok_s", "reply_s")}
        mask = [r["mask_us_per_token"] for r in runs[way] if r["mask_us_per_token"] is not None]
        rows.append({"task": task, "way": way, "decode_tok_s": med["decode_tok_s"], "reply_s": med["reply_s"],
                     "new_tokens": last["new_tokens"], "forced_tokens": last["forced_tokens"],
                     "sampled_tokens": last["sampled_tokens"], "decode_steps": last["decode_steps"],
                     "mask_us_per_token": statistics.median(mask) if way != "free" else None,
                     "finish_reason": last["finish_reason"], "valid": validates(texts[way], schema),
                     "text": texts[way], "runs": runs[way]})
        log(f"{task} {way}: {med['decode_tok_s']:.1f} tok/s, {last['new_tokens']} tokens "
            f"({last['forced_tokens']} forced) in {last['decode_steps']} steps")
    base = rows[0]["decode_tok_s"]
    for row in rows:
        row["vs_free"] = round(row["decode_tok_s"] / base, 3) if base else None
    same = rows[1]["text"] == rows[2]["text"]
    rows[2]["same_text_as_schema"] = same
    return rows


def markdown(rows: list[dict], args) -> str:
    lines = [f"Structured output, {args.model}, greedy, {args.threads} CPU threads, median of {args.repeat}:", "",
             "| task | way | decode tok/s | vs free | reply s | tokens (forced) | decode steps | grammar µs/token | valid JSON |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mask = "-" if r["mask_us_per_token"] is None else f"{r['mask_us_per_token']:.0f}"
        lines.append(f"| {r['task']} | {r['way']} | {r['decode_tok_s']:.1f} | {r['vs_free']:.2f}x | {r['reply_s']:.2f} |"
                     f" {r['new_tokens']} ({r['forced_tokens']}) | {r['decode_steps']} | {mask} |"
                     f" {'yes' if r['valid'] else 'no'} |")
    same = [r["task"] for r in rows if r.get("same_text_as_schema") is False]
    lines.append("")
    lines.append("jump-forward output identical to plain constrained output: "
                 + ("yes, every task" if not same else f"NO for {', '.join(same)}"))
    return "\n".join(lines) + "\n"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="model (default: the embedded smollm2)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each way; figures are medians (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    parser.add_argument("--new-tokens", type=int, default=200, help="most tokens per reply (default 200)")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated (default: {','.join(TASKS)})")
    parser.add_argument("--out", type=Path, help="the JSON file (default bench/runs/DATE-cpuTHREADS-structured.json)")
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",")
    if unknown := [t for t in tasks if t not in TASKS]:
        parser.error(f"unknown task {unknown[0]!r}; choose from {', '.join(TASKS)}")
    if args.repeat < 1 or args.threads < 1 or args.new_tokens < 8:
        parser.error("--repeat and --threads must be at least 1, --new-tokens at least 8")
    torch.set_num_threads(args.threads)
    today = datetime.date.today().isoformat()
    out = args.out or HERE / "runs" / f"{today}-cpu{args.threads}-structured.json"
    load_start = os.getloadavg()[0]
    engine = Engine(load_model(args.model, "cpu", "fp32"), max_len=1024)
    rows = [row for task in tasks for row in measure(engine, task, args)]
    table = markdown(rows, args)
    doc = {"date": today,
           "command": " ".join(["python", "bench/structured.py", *(argv if argv is not None else sys.argv[1:])]),
           "settings": {"model": args.model, "threads": args.threads, "repeat": args.repeat, "new_tokens": args.new_tokens},
           "load_average_1min": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2), "cores": os.cpu_count()},
           "environment": bench.environment("cpu"), "schemas": {t: TASKS[t][1] for t in tasks}, "results": rows}
    bench.write_run(out, doc, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
