"""Memory figures for the status line, `/stats` and `llmrun bench`."""

from __future__ import annotations

import resource
import sys


def process_peak_rss() -> int:
    """Peak resident memory of this process, bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def kv_figures(cache) -> dict:
    """The KV cache's format, eviction, the bytes its tokens would take in fp16, and its compression against that."""
    in_use = cache.bytes_in_use()
    fp16 = cache.fp16_equivalent()
    ev = cache.eviction
    return {
        "kv_format": cache.format,
        "kv_eviction": None if ev is None else {"policy": ev.policy, "budget": ev.budget, "sinks": ev.sinks,
                                                "evicted_tokens": cache.evicted},
        "kv_fp16_equivalent": fp16,
        "kv_compression": round(fp16 / in_use, 3) if in_use else None,
    }


def memory_report(engine) -> dict:
    """Bytes: weights, KV cache allocated and in use, process peak; a draft model's own weights and KV cache;
    on CUDA the device's peaks."""
    import torch

    report = {
        "weights": engine.loaded.weight_bytes,
        "kv_allocated": engine.cache.nbytes,
        "kv_in_use": engine.cache.bytes_in_use(),
        **kv_figures(engine.cache),
        "process_peak_rss": process_peak_rss(),
    }
    drafter = getattr(getattr(engine, "speculator", None), "drafter", None)
    if getattr(drafter, "engine", None) is not None:  # a draft model: what it adds to the target's memory
        shared = {t.data_ptr() for t in engine.model.state_dict().values()}
        draft = drafter.engine
        report["draft_weights"] = sum(t.nbytes for t in draft.model.state_dict().values() if t.data_ptr() not in shared)
        report["draft_kv_allocated"] = draft.cache.nbytes
    if engine.device.type == "cuda":
        report["device_peak_allocated"] = torch.cuda.max_memory_allocated(engine.device)
        report["device_peak_reserved"] = torch.cuda.max_memory_reserved(engine.device)
    return report


def human_bytes(n: float) -> str:
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
