"""`llmrun bench --sweep`: measure a grid of configurations, rank them for a goal, recommend one.

The grid is the product of the `AXES` table: each axis names a `Settings` field, the values swept by default on
each device, and the command-line flag that sets it. A new knob (KV cache format or eviction, drafter, draft
length) is a new Settings field and one new entry here.

Quality is measured, cheaply, against the most precise configuration (fp32 weights expanded, `REFERENCE`):
teacher-forced on the bench prompt, the mean KL divergence of each configuration's next-token distribution
from the reference's, and how often their top-1 tokens agree.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Callable

from llmrun.bench import MAX_THREADS
from llmrun.errors import LlmrunError, UsageError

GOALS = ("latency", "memory", "quality")
REFERENCE = {"dtype": "fp32", "weights": "dequant"}
QUALITY_POSITIONS = 128  # prompt positions scored: enough for a stable mean, bounded (T x vocab) logits
KL_RESOLUTION = 1e-3  # nats: the `quality` goal treats KL differences below this as ties (then: faster first)


@dataclass(frozen=True)
class Axis:
    field: str  # the Settings field it sets
    flag: str  # the command-line flag that sets it
    choices: tuple[str, ...] | None  # allowed values; None: positive integers
    defaults: Callable[[str], tuple]  # device type -> values swept when --axis does not say; () = not swept


AXES: dict[str, Axis] = {
    "dtype": Axis("dtype", "--dtype", ("fp32", "bf16", "fp16"),
                  lambda device: ("bf16", "fp16") if device == "cuda" else ("fp32", "bf16")),
    "weights": Axis("weights", "--weights", ("auto", "dequant", "int4"), lambda device: ("auto", "dequant")),
    "threads": Axis("threads", "--threads", None, lambda device: ()),
    "kv": Axis("kv", "--kv", ("auto", "fp32", "bf16", "fp16", "int8", "int4"), lambda device: ()),
}


def parse_axes(specs: list[str]) -> dict[str, tuple]:
    """`--axis NAME=V1,V2` options -> {name: values}, checked against AXES."""
    out: dict[str, tuple] = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip()
        if not sep or not values.strip():
            raise UsageError(f"--axis {spec!r}: write NAME=VALUE[,VALUE...], e.g. --axis dtype=fp32,bf16")
        if name not in AXES:
            raise UsageError(f"--axis {spec!r}: unknown axis {name!r}; axes: {', '.join(AXES)}")
        if name in out:
            raise UsageError(f"--axis {name} is given twice; list its values in one: --axis {name}=V1,V2")
        axis, parsed = AXES[name], []
        for value in (v.strip() for v in values.split(",")):
            if axis.choices is not None and value not in axis.choices:
                raise UsageError(f"--axis {name}: {value!r} is not one of {', '.join(axis.choices)}")
            if axis.choices is None:
                if not value.isdigit() or not 1 <= int(value) <= MAX_THREADS:
                    raise UsageError(f"--axis {name}: {value!r} is not a positive integer up to {MAX_THREADS}")
                value = int(value)
            if value not in parsed:
                parsed.append(value)
        out[name] = tuple(parsed)
    return out


def grid(base, overrides: dict[str, tuple]) -> list:
    """Every combination of the swept axes' values, applied to the resolved Settings `base`."""
    swept = {name: overrides.get(name) or axis.defaults(base.device) for name, axis in AXES.items()}
    swept = {name: values for name, values in swept.items() if values}
    names = list(swept)
    return [dataclasses.replace(base, **{AXES[n].field: v for n, v in zip(names, combo)})
            for combo in itertools.product(*(swept[n] for n in names))]


def points(base, overrides: dict[str, tuple]) -> int:
    """The sweep's measurement points: a configuration of the grid each, and the quality reference when the grid
    lacks it (`run_sweep` announces each as it starts)."""
    settings = grid(base, overrides)
    return len(settings) + (not any(_is_reference(s) for s in settings))


def swept_axes(overrides: dict[str, tuple], device: str) -> list[str]:
    return [name for name, axis in AXES.items() if overrides.get(name) or axis.defaults(device)]


def flags(settings, axes: list[str]) -> str:
    """The command-line flags that select `settings` on the swept axes, e.g. `--dtype bf16 --weights auto`."""
    return " ".join(f"{AXES[name].flag} {getattr(settings, AXES[name].field)}" for name in axes)


# --- quality ----------------------------------------------------------------------------------------------------


def next_token_logprobs(engine, prompt: list[int]):
    """Teacher-forced log-probabilities of every next token over the prompt's first QUALITY_POSITIONS tokens,
    (T, V) fp32 on the CPU."""
    import torch

    engine.reset()
    logits = engine.forward(list(prompt[:QUALITY_POSITIONS]), last_only=False)  # (T, V)
    engine.reset()
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def quality(reference, logprobs) -> dict:
    """Mean KL(reference || configuration) in nats, and the share of positions whose top-1 tokens agree."""
    kl = (reference.exp() * (reference - logprobs)).sum(-1).mean()
    agree = (reference.argmax(-1) == logprobs.argmax(-1)).float().mean()
    return {"kl": round(max(float(kl), 0.0), 6), "top1_agreement": round(float(agree), 4)}


# --- ranking ----------------------------------------------------------------------------------------------------


def peak_memory(row: dict) -> int:
    """The memory a configuration needed at its peak: the device's on GPU, the process's resident set on CPU."""
    memory = row["memory"]
    return memory["device_peak_allocated"] if memory.get("device_peak_allocated") is not None else memory["process_peak_rss"]


def _sort_key(row: dict, goal: str):
    decode = row["decode_tok_s"]["median"]
    if goal == "latency":
        return (-decode, row["ttft_s"])
    if goal == "memory":
        return (peak_memory(row), -decode)
    kl = row.get("kl")
    return (kl is None, math.inf if kl is None else round(kl / KL_RESOLUTION), -decode)


def rank(rows: list[dict], goal: str) -> list[dict]:
    """Rows best first for `goal`. latency: decode tok/s (ties: time to first token); memory: peak memory
    (ties: decode speed); quality: KL to the reference at KL_RESOLUTION, rows without one after (ties: decode
    speed). Rows whose configuration failed (`error`) come last, in their original order."""
    if goal not in GOALS:
        raise LlmrunError(f"unknown goal {goal!r}; choose one of {', '.join(GOALS)}")
    good = [r for r in rows if not r.get("error")]
    return sorted(good, key=lambda r: _sort_key(r, goal)) + [r for r in rows if r.get("error")]


# --- the sweep --------------------------------------------------------------------------------------------------


def _is_reference(settings) -> bool:
    return all(getattr(settings, field) == value for field, value in REFERENCE.items())


def _reference_logprobs(files, base, workload, progress):
    """Log-probabilities of the reference configuration, or None (with why) when it cannot be loaded here."""
    import torch

    from llmrun import bench

    reference = dataclasses.replace(base, **REFERENCE, ctx=min(base.ctx, QUALITY_POSITIONS + 1))
    progress(f"quality reference ({flags(reference, ['dtype', 'weights'])})")
    try:
        with bench.torch_threads(reference.threads):
            engine = bench.open_engine(files, reference)
            try:
                return next_token_logprobs(engine, workload.prompt), None
            finally:
                del engine
                bench.release(base.device)
    except (LlmrunError, MemoryError, torch.OutOfMemoryError) as e:
        return None, f"no quality figures: the fp32 reference does not load ({bench.one_line(e)})"


def run_sweep(files, base, workload, overrides: dict[str, tuple], known: dict | None = None,
              progress: Callable[[str], None] = lambda message: None) -> tuple[list[dict], list[str]]:
    """Measure every configuration of the grid around the resolved Settings `base`: (rows, notes).

    `known`: figures already measured for one Settings (the configured run), reused rather than measured
    again. A configuration that fails to load or runs out of memory gives a row with `error` set.
    """
    import torch

    from llmrun import bench

    axes = swept_axes(overrides, base.device)
    settings = sorted(grid(base, overrides), key=lambda s: not _is_reference(s))  # the reference first, if swept
    reference, notes = None, []
    if not _is_reference(settings[0]):
        reference, note = _reference_logprobs(files, base, workload, progress)
        notes += [note] if note else []
    rows = []
    for i, s in enumerate(settings, 1):
        row = {"config": s.describe(), "flags": flags(s, axes), "error": None, "kl": None, "top1_agreement": None,
               **dict.fromkeys(SWEEP_FIGURES)}  # figures stay None where the configuration failed
        progress(f"sweep {i}/{len(settings)}: {row['flags']}")
        try:
            with bench.torch_threads(s.threads):
                engine = bench.open_engine(files, s)
                try:
                    if known is not None and known["settings"] == s:
                        figures = known["figures"]
                    else:
                        figures = bench.measure(engine, workload)
                    logprobs = next_token_logprobs(engine, workload.prompt)
                    if reference is None and i == 1 and _is_reference(s):
                        reference = logprobs
                    if reference is not None:
                        row.update(quality(reference, logprobs))
                finally:
                    del engine
                    bench.release(s.device)
        except (LlmrunError, MemoryError, torch.OutOfMemoryError) as e:
            rows.append({**row, "error": bench.one_line(e)})
            continue
        rows.append({**row, **_sweep_figures(figures)})
    if reference is None and not notes:
        notes.append("no quality figures: the fp32 reference configuration failed")
    return rows, notes


SWEEP_FIGURES = ("ttft_s", "prefill_tok_s", "decode_tok_s", "e2e_tok_s", "weights_loaded", "memory", "weight_bytes",
                 "bytes_per_token", "bandwidth_gb_s", "bandwidth_share")


def _sweep_figures(figures: dict) -> dict:
    return {key: figures[key] for key in SWEEP_FIGURES}


def recommend(ranked: list[dict], goal: str) -> dict | None:
    best = next((r for r in ranked if not r.get("error")), None)
    return None if best is None else {"goal": goal, "flags": best["flags"], "config": best["config"]}


def plot(rows: list[dict], recommended: dict | None, path, title: str) -> None:
    """Decode speed against peak memory, one labelled point per configuration; the recommended one stands out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    points = sorted((r for r in rows if not r.get("error")), key=lambda r: r["decode_tok_s"]["median"])
    speeds = [r["decode_tok_s"]["median"] for r in points]
    close = 0.05 * (max(speeds, default=0) - min(speeds, default=0))
    for i, row in enumerate(points):
        x, y = peak_memory(row) / 2**20, speeds[i]
        best = recommended is not None and row["flags"] == recommended["flags"]
        ax.scatter([x], [y], s=80 if best else 40, color="tab:red" if best else "tab:blue", zorder=3)
        label = row["flags"] + (f" · KL {row['kl']:.4f}" if row.get("kl") is not None else "")
        below = i + 1 < len(points) and speeds[i + 1] - y <= close  # a point just above: write under this one
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, -12 if below else 6), fontsize=8)
    ax.margins(x=0.35, y=0.15)
    ax.set_xlabel("peak memory (MiB)")
    ax.set_ylabel("decode tok/s (median)")
    ax.set_title(title + (f" — recommended for {recommended['goal']}: {recommended['flags']}" if recommended else ""),
                 fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
