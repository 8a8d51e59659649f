"""Measure one configuration on one workload: time to first token, prefill and decode speed, memory, and the
memory bandwidth decoding achieves.

Every run is greedy and decodes exactly `new_tokens` tokens (end-of-sequence tokens do not stop it), from an
empty KV cache, so runs, configurations and peers (`llmrun.peers`) are comparable. The timing loop drives a
`Runner` (prefill / decode / argmax); llmrun's Engine is one runner, llama.cpp and transformers are others.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import gc
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from llmrun.errors import LlmrunError, UsageError, not_finite

DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
MAX_THREADS = 1024  # far past any one machine's cores; OpenMP fails to create tens of thousands (or crashes)


@dataclass(frozen=True)
class Settings:
    """One configuration of llmrun. The sweep's axes (`llmrun.sweep.AXES`) each set one field."""

    device: str = "auto"  # auto | cpu | cuda (a resolved Settings holds cpu or cuda)
    dtype: str = "auto"  # auto | fp32 | bf16 | fp16
    weights: str = "auto"  # auto (packed quantized weights, llmrun's kernels) | dequant (plain PyTorch eager)
    threads: int | None = None  # CPU threads; None: PyTorch's choice
    ctx: int | None = None  # KV cache positions
    kv: str = "auto"  # KV cache format (llmrun.kv_cache.KV_FORMATS); auto: the compute dtype
    kv_evict: str | None = None  # eviction policy (window | h2o) with ...
    kv_budget: int | None = None  # ... this many tokens kept, ...
    kv_sinks: int = 4  # ... the first this many always among them

    def describe(self) -> dict:
        return dataclasses.asdict(self)


def resolve(settings: Settings, default_ctx: int) -> Settings:
    """Replace every `auto`/None by what it means on this machine, so figures say what produced them."""
    import torch

    from llmrun.loading import resolve_device, resolve_dtype

    device = resolve_device(settings.device)
    dtype = DTYPE_NAMES[str(resolve_dtype(settings.dtype, device)).removeprefix("torch.")]
    from llmrun import threads as pool

    threads = settings.threads or pool.most()  # (not what a busy CPU's governor uses now: `llmrun.threads`)
    return dataclasses.replace(settings, device=device.type, dtype=dtype, threads=threads, ctx=settings.ctx or default_ctx)


@contextmanager
def torch_threads(n: int | None):
    """Run with `n` CPU threads, then give back the previous count (a sweep changes it per configuration)."""
    from llmrun import threads

    before = threads.most()
    if n:
        threads.set_threads(n)
    try:
        yield
    finally:
        threads.set_threads(before)


def open_engine(files, settings: Settings, loaded=None):
    """An Engine for `files` (a model's files, or a random-weight shape) as a resolved `settings` says; on `loaded`
    (what `load` gave for the same device, dtype and weights) rather than loading them again, if given."""
    from llmrun.generate import Engine

    loaded = loaded or load(files, settings)
    eviction = None
    if settings.kv_evict is not None:
        from llmrun.kv_cache import Eviction

        eviction = Eviction(settings.kv_evict, settings.kv_budget, settings.kv_sinks)
    return Engine(loaded, settings.ctx, kv_format=None if settings.kv == "auto" else settings.kv, eviction=eviction)


def load(files, settings: Settings):
    """The LoadedModel of `files` (a model's files, or a random-weight shape: refused with one line when it and
    its KV cache would not fit) as a resolved `settings` says."""
    import torch

    from llmrun.loading import load_weights, resolve_dtype

    if files.source.format == "random":
        from llmrun.shapes import check_fits, load_random

        device = torch.device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        name = files.source.spec.removeprefix("random:")
        budget = settings.kv_budget if settings.kv_evict is not None else settings.ctx
        check_fits(name, files.config, device, dtype, budget, None if settings.kv == "auto" else settings.kv,
                   int4=settings.weights == "int4")
        return load_random(files, device, dtype, settings.weights)
    return load_weights(files, device=settings.device, dtype=settings.dtype, weights=settings.weights)


def one_line(e: BaseException, with_type: bool = False) -> str:
    """An exception as one line for a table cell: its message's first line (after its type, when asked; a
    third-party engine's errors need it), or its type when it has no message."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return f"{type(e).__name__}: {lines[0][:200]}" if with_type else lines[0][:200]


def release(device_type: str) -> None:
    """Free what the last configuration held before the next one loads (and before its peak is measured)."""
    gc.collect()
    if device_type == "cuda":
        import torch

        torch.cuda.empty_cache()
    _trim_heap()


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim), so that the resident set, whose peak
    is a CPU configuration's memory figure, holds what is alive: freed tensors' pages otherwise stay resident in
    the heap, and every later configuration's peak counted the earlier ones' (a sweep ranked its rows for memory
    by the order they ran). Nothing where the C library has no malloc_trim."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


# --- timing ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    prefill_s: float  # the prompt's forward
    ttft_s: float  # prefill plus picking the first token: when it is known on the host
    decode_s: float  # the new_tokens - 1 decode steps that follow
    prompt_tokens: int
    new_tokens: int

    @property
    def decode_tok_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s

    @property
    def e2e_tok_s(self) -> float:
        return self.new_tokens / (self.ttft_s + self.decode_s)


class EngineRunner:
    """llmrun's Engine as a Runner: prefill(ids) and decode(token) give logits; argmax picks the token."""

    def __init__(self, engine):
        self.engine = engine

    def reset(self) -> None:
        self.engine.reset()

    def prefill(self, ids: list[int]):
        return self.engine.prefill(ids)[0]

    def decode(self, token: int):
        return self.engine.decode(token)

    def argmax(self, logits) -> int:
        return int(logits.argmax())

    @property
    def dtype(self):
        return self.engine.loaded.dtype

    def finite(self, logits) -> bool:
        import torch

        return bool(torch.isfinite(logits).all())

    def decode_greedy(self, token: int, steps: int) -> None:
        """`steps` greedy decode steps after `token`, as a reply runs them (`Engine.plain_steps`: on a GPU each
        step is enqueued before the host reads the token it feeds)."""
        from llmrun.sampling import Randomness, SamplingParams

        for _ in self.engine.plain_steps(token, SamplingParams(temperature=0), Randomness(0), steps):
            pass

    def sync(self) -> None:
        if self.engine.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.engine.device)


def time_run(runner, prompt: list[int], new_tokens: int) -> Run:
    """One greedy run from an empty cache: prefill the prompt, then exactly new_tokens - 1 decode steps."""
    runner.reset()
    runner.sync()
    t0 = time.perf_counter()
    logits = runner.prefill(prompt)
    runner.sync()
    t1 = time.perf_counter()
    token = runner.argmax(logits)  # on the host: a sync point
    t2 = time.perf_counter()
    if hasattr(runner, "decode_greedy"):  # the runner's own loop (the last token read on the host ends it)
        runner.decode_greedy(token, new_tokens - 1)
    else:
        for _ in range(new_tokens - 1):
            token = runner.argmax(runner.decode(token))
    t3 = time.perf_counter()
    finite = getattr(runner, "finite", None)  # (after the timing) NaN or inf logits would time garbage
    if finite is not None and not finite(logits):
        raise not_finite(runner.dtype)
    return Run(t1 - t0, t2 - t0, t3 - t2, len(prompt), new_tokens)


def time_runs(runner, workload, after_warmup=None) -> list[Run]:
    """The workload's timed runs, after one untimed warm-up run when it asks for one; `after_warmup()` is called
    just before the timed runs."""
    prompt = list(workload.prompt)
    if workload.warmup:
        time_run(runner, prompt, workload.new_tokens)
    if after_warmup is not None:
        after_warmup()
    return [time_run(runner, prompt, workload.new_tokens) for _ in range(workload.repeat)]


def speed_figures(runs: list[Run]) -> dict:
    """Medians over the runs (decode also min and max)."""
    decode = [r.decode_tok_s for r in runs]
    prefill_s = statistics.median(r.prefill_s for r in runs)
    return {
        "ttft_s": round(statistics.median(r.ttft_s for r in runs), 5),
        "prefill_tok_s": round(runs[0].prompt_tokens / prefill_s, 2),
        "decode_tok_s": {"median": round(statistics.median(decode), 2), "min": round(min(decode), 2),
                         "max": round(max(decode), 2)},
        "e2e_tok_s": round(statistics.median(r.e2e_tok_s for r in runs), 2),
    }


# --- memory and bandwidth -------------------------------------------------------------------------------------


def reset_peak_memory(device) -> None:
    """Start the peaks afresh: CUDA's allocator statistics, and on Linux the process's RSS high-water mark."""
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (Linux >= 4.0)
    except OSError:
        pass  # elsewhere the peak covers the whole process, loading included


def proc_bytes(path: str, key: str) -> int | None:
    """A `Key:  N kB` line of a Linux /proc file, in bytes; None where there is no such file or line."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss() -> int:
    """The process's peak resident memory since the last reset_peak_memory, bytes."""
    from llmrun.memory import process_peak_rss

    peak = proc_bytes("/proc/self/status", "VmHWM")
    return process_peak_rss() if peak is None else peak


def memory_figures(engine) -> dict:
    import torch

    from llmrun.memory import kv_figures

    device = engine.device
    cuda = device.type == "cuda"
    return {
        "weights": engine.loaded.weight_bytes,
        "kv_allocated": engine.cache.nbytes,
        "kv_in_use": engine.cache.bytes_in_use(),
        **kv_figures(engine.cache),
        "process_peak_rss": peak_rss(),
        "device_peak_allocated": torch.cuda.max_memory_allocated(device) if cuda else None,
        "device_peak_reserved": torch.cuda.max_memory_reserved(device) if cuda else None,
    }


def weight_bytes_read_per_token(loaded) -> int:
    """Weight bytes one decode step reads: all of them, except a token-embedding table that is not also the output
    head (an untied one, or a tied one whose head `--weights int4` made a copy of), of which one row is read."""
    total = loaded.weight_bytes
    embed = getattr(loaded.model, "embed", None)
    if embed is not None and getattr(loaded.model, "lm_head", None) is not None:
        table = sum(t.nbytes for t in embed.parameters()) + sum(t.nbytes for t in embed.buffers())
        total -= table - table // loaded.model.config.vocab_size
    return total


@functools.cache
def copy_bandwidth(device_type: str) -> float:
    """The device's memory bandwidth as a large copy achieves it (bytes read + written per second), measured
    once per process: the ceiling a memory-bound decode step can approach."""
    import torch

    device = torch.device(device_type)
    cuda = device.type == "cuda"
    n = (1 << 30) if cuda else (256 << 20)
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults and lazy allocation are not bandwidth
    best = float("inf")
    for _ in range(10 if cuda else 4):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    release(device.type)
    return 2 * n / best


def measure(engine, workload) -> dict:
    """Every figure of one configuration on `workload` (see the README's Benchmarks section for the keys)."""
    runs = time_runs(EngineRunner(engine), workload, after_warmup=lambda: reset_peak_memory(engine.device))
    return run_figures(engine, workload, runs)


def run_figures(engine, workload, runs: list[Run], tokens_per_step: float | None = None,
                acceptance_rate: float | None = None) -> dict:
    """The figures of `runs` just timed on `engine`: speed, memory, bandwidth. Speculative runs give their
    `tokens_per_step` (the target reads its weights once per step, not per token) and `acceptance_rate`."""
    memory = memory_figures(engine)  # before copy_bandwidth's buffers raise the peak
    figures = speed_figures(runs)
    prompt, new = len(workload.prompt), workload.new_tokens
    kv_per_token = engine.cache.nbytes // engine.cache.max_len
    # Decode step i (1..new-1) attends over prompt + i positions (on average prompt + new/2), or over the cache's
    # max_len where an evicting cache holds no more than its budget
    held = [min(prompt + i, engine.cache.max_len) for i in range(1, new) or [new / 2]]
    read_per_token = weight_bytes_read_per_token(engine.loaded) + round(kv_per_token * sum(held) / len(held))
    steps_per_s = figures["decode_tok_s"]["median"] / (tokens_per_step or 1.0)
    achieved = read_per_token * steps_per_s  # the target's reads; a draft model's are not counted
    peak = copy_bandwidth(engine.device.type)
    return {
        **figures,
        # what --weights auto became: "packed" (quantized blocks, llmrun's kernels) or "dequant"
        "weights_loaded": engine.loaded.weights,
        # whether decode steps ran as CUDA graphs (`llmrun.cuda_graphs`)
        "cuda_graphs": getattr(engine, "graphs", None) is not None and not engine.graphs.failed,
        "memory": memory,
        "weight_bytes": memory["weights"],
        "kv_bytes_per_token": kv_per_token,
        "kv_bytes_in_use": memory["kv_in_use"],
        "bytes_per_token": read_per_token,
        "bandwidth_gb_s": round(achieved / 1e9, 3),
        "bandwidth_peak_gb_s": round(peak / 1e9, 3),
        "bandwidth_share": round(achieved / peak, 4),
        # speculative decoding (`llmrun.bench_speculative`): accepted / proposed draft tokens, and the mean
        # tokens committed per target-model step; None without a drafter
        "acceptance_rate": None if acceptance_rate is None else round(acceptance_rate, 4),
        "tokens_per_step": None if tokens_per_step is None else round(tokens_per_step, 3),
        "speculative": None,  # with a drafter: the comparison with plain decoding
        # e.g. why the fast path is off, a Triton kernel that failed (its slow reference ran), graphs that failed
        "notes": list(engine.loaded.notes) + run_notes(engine),
    }


def run_notes(engine) -> list[str]:
    """What a run's figures should say of how it ran, beyond the settings: fallbacks taken while it ran."""
    from llmrun import kernels

    notes = [f"the GPU kernel {name} failed here: its PyTorch reference ran instead" for name in kernels.failed()]
    graphs = getattr(engine, "graphs", None)
    if graphs is not None and graphs.failed:
        notes.append(f"capturing CUDA graphs failed ({graphs.failed}): decode steps ran eagerly")
    return notes


def measure_settings(files, settings: Settings, workload, compiled: bool = False) -> dict:
    """Load `files` as a resolved `settings` says, measure the workload, free the model: the figures. `compiled`:
    decode steps through torch.compile (`llmrun.compiled`, the plain path's gpt-fast baseline)."""
    with torch_threads(settings.threads):
        engine = open_engine(files, settings)
        try:
            if compiled:
                from llmrun.compiled import CompiledDecode

                engine.graphs = CompiledDecode(engine.model, engine.cache)
            return measure(engine, workload)
        finally:
            del engine
            release(settings.device)


def check_fits_context(prompt_tokens: int, new_tokens: int, ctx: int, trained: int | None = None) -> None:
    """A run must fit the context of `ctx` positions (at most `trained`, the model's own, when given): the prompt
    and every new token but the last, which is never fed back, so never cached."""
    need = prompt_tokens + max(new_tokens - 1, 0)
    if need > ctx:
        fix = "lower --prompt-tokens/--new-tokens"
        if trained is None or ctx < min(trained, need):
            fix = f"raise --ctx{'' if trained is None else f' (up to {trained})'} or {fix}"
        elif trained < need:
            fix += f" (the model's context is {trained} positions), or bound the cache with --kv-evict"
        raise UsageError(
            f"the prompt ({prompt_tokens} tokens) and --new-tokens {new_tokens} need {need} positions (the last new"
            f" token is not cached) but the context holds {ctx}; {fix}"
        )


# --- the whole report ---------------------------------------------------------------------------------------------


def describe(settings: Settings) -> str:
    """A resolved Settings in words, e.g. `cpu fp32 --weights auto, 2 threads, ctx 8192`."""
    kv = "" if settings.kv in ("auto", settings.dtype) else f" --kv {settings.kv}"
    if settings.kv_evict is not None:
        kv += f" --kv-evict {settings.kv_evict} --kv-budget {settings.kv_budget} --kv-sinks {settings.kv_sinks}"
    threads = f"{settings.threads} thread{'' if settings.threads == 1 else 's'}"
    return f"{settings.device} {settings.dtype} --weights {settings.weights}{kv}, {threads}, ctx {settings.ctx}"


def compiled_row(settings: Settings) -> bool:
    """Whether --compare measures the plain path compiled: on CUDA (mode "reduce-overhead" is CUDA graphs), with a
    cache that holds every token."""
    return settings.device.startswith("cuda") and settings.kv_evict is None


def compare_rows(files, settings: Settings, figures: dict, workload, progress) -> list[dict]:
    """llmrun as configured, its plain-PyTorch eager path (`--weights dequant`), on CUDA that path compiled
    (torch.compile, mode "reduce-overhead": gpt-fast's recipe), then the peers; with ratios."""
    from llmrun import __version__, peers

    import torch

    rows = [peers.row("llmrun", f"{settings.dtype} --weights {settings.weights}", figures, version=__version__)]
    eager = dataclasses.replace(settings, weights="dequant")
    config = f"{eager.dtype} --weights dequant (plain PyTorch)"
    progress("compare: llmrun eager (--weights dequant)")
    # (A float model under --weights auto is no plain-PyTorch run either: llmrun's C kernels serve its norms and
    # attention on a CPU, the Triton kernels and CUDA graphs its whole step on CUDA.)
    if eager == settings:
        rows.append(peers.row("llmrun eager", config, version=__version__,
                              skipped="the configured run is already the eager path (--weights dequant)"))
    else:
        try:
            rows.append(peers.row("llmrun eager", config, measure_settings(files, eager, workload), version=__version__))
        except (LlmrunError, MemoryError, torch.OutOfMemoryError) as e:
            rows.append(peers.row("llmrun eager", config, version=__version__, skipped=f"failed: {one_line(e)}"))
    if compiled_row(settings):
        config = f"{eager.dtype} --weights dequant, torch.compile(mode='reduce-overhead')"
        progress("compare: llmrun eager compiled (torch.compile)")
        try:
            figures = measure_settings(files, eager, workload, compiled=True)
            rows.append(peers.row("llmrun compiled", config, figures, version=torch.__version__))
        except Exception as e:  # noqa: BLE001 - the compiler failing is this row's result, not the benchmark's
            rows.append(peers.row("llmrun compiled", config, version=torch.__version__,
                                  skipped=f"failed: {one_line(e, with_type=True)}"))
    rows += peers.peer_rows(files, settings, workload, progress)
    return peers.add_ratios(rows)


def environment(device: str) -> dict:
    """What produced the figures: the device's name, the versions, the commit ($LLMRUN_COMMIT, else `git`: a
    copy of the tree, as a lent GPU machine gets, may carry a stale .git)."""
    import platform

    import torch

    from llmrun import __version__

    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = platform.processor() or platform.machine()
        try:
            name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                        if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit = os.environ.get("LLMRUN_COMMIT") or _source_commit()
    settings = {k: v for k, v in sorted(os.environ.items())  # a profile's variant, or a path turned off
                if k.startswith("LLMRUN_GEMV_") or k in ("LLMRUN_PDL", "LLMRUN_PIPELINE", "LLMRUN_NO_CUDA_GRAPHS")}
    return {"device_name": name, "cpu_count": os.cpu_count(), "torch": torch.__version__, "triton": triton_version,
            "llmrun": __version__, "commit": commit, "python": platform.python_version(), **settings}


def _source_commit(root: Path = Path(__file__).resolve().parent.parent) -> str | None:
    """The commit of the checkout llmrun runs from (`root`: the folder holding the package, the checkout's own top
    in an editable install), or None: an installed package has none, even inside someone else's git work tree (a
    wheel in `myproject/.venv`)."""
    import subprocess

    try:  # (one line each: the work tree's top, then HEAD; nothing on stdout outside a work tree)
        said = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=5).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return said[1] if len(said) == 2 and Path(said[0]).resolve() == root else None


def write_run(out: Path, doc: dict, table: str) -> None:
    """A benchmark script's record: the JSON document at `out`, its Markdown table beside it (.md); the table
    printed on stdout, where both went on stderr."""
    import json
    import sys

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(table)
    print(table, end="" if table.endswith("\n") else "\n")
    print(f"wrote {out} and {out.with_suffix('.md')}", file=sys.stderr)


def benchmark(files, settings: Settings, workload, *, model: str, compare: bool = False,
              sweep_axes: dict | None = None, goal: str = "latency", drafting=None,
              progress=lambda done, total, what: None) -> dict:
    """Everything `llmrun bench` reports, as one JSON-ready document: the configured run's figures, and with
    `compare` the peers side by side, with `sweep_axes` ({axis: values}; {} for the defaults) a ranked sweep.
    With `drafting` (a `bench_speculative.Drafting`) the figures are the speculative runs', and `speculative`
    compares them with plain decoding; not with `compare` or `sweep_axes`.

    `progress(done, total, what)` is called as each measurement point (a configuration loaded and measured, a
    peer) starts, and once more when all `total` are done."""
    from llmrun import peers, sweep

    total = (1 + (1 + compiled_row(settings) + len(peers.PEERS) if compare else 0)
             + (sweep.points(settings, sweep_axes) if sweep_axes is not None else 0))
    started = 0

    def point(what: str) -> None:  # the steps below announce each point as it starts
        nonlocal started
        progress(started, total, what)
        started += 1

    if drafting is not None:
        from llmrun.bench_speculative import measure_speculative_settings

        if compare or sweep_axes is not None:
            raise UsageError("speculative decoding is measured against plain decoding on its own; run --compare"
                              " or --sweep without --ngram/--draft")
        point(f"measuring {model} ({describe(settings)}), plain and {drafting.flags()}")
        figures = measure_speculative_settings(files, settings, workload, drafting)
    else:
        point(f"measuring {model} ({describe(settings)})")
        figures = measure_settings(files, settings, workload)
    doc = {"model": model, "config": settings.describe(), "workload": workload.describe(), **figures,
           "compare": None, "sweep": None, "recommended": None, "environment": environment(settings.device)}
    doc["notes"] = doc.pop("notes")  # last, after the sweep's
    if compare:
        doc["compare"] = compare_rows(files, settings, figures, workload, point)
    if sweep_axes is not None:
        rows, notes = sweep.run_sweep(files, settings, workload, sweep_axes,
                                      known={"settings": settings, "figures": figures}, progress=point)
        ranked = sweep.rank(rows, goal)
        doc["sweep"] = [{"rank": i, **r} for i, r in enumerate(ranked, 1)]
        doc["recommended"] = sweep.recommend(ranked, goal)
        doc["notes"] += notes
    progress(total, total, "done")
    return doc
