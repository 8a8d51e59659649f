"""Memory figures for the status line, `/stats` and `llmrun bench`."""

from __future__ import annotations

import resource
import sys


def process_peak_rss() -> int:
    """Peak resident memory of this process, bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def memory_report(engine) -> dict:
    """Bytes: weights, KV cache allocated and in use, process peak; a draft model's own weights and KV cache;
    on CUDA the device's peaks."""
    import torch

    report = {
        "weights": engine.loaded.weight_bytes,
        "kv_allocated": engine.cache.nbytes,
        "kv_in_use": engine.cache.bytes_in_use(),
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
