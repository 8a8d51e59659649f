"""CUDA graphs of the decode step: the whole forward of a decode step (or a verification block) captured once per
number of tokens (and span of cache slots, `DecodeGraphs`) and replayed for every later step, so the GPU runs the
step's hundreds of kernels back to back with no Python and no launch overhead between them.

A graph replays fixed kernels on fixed memory, so the step must not depend on host values that change: the tokens,
their positions and their cache slots go into static device buffers before each replay, the cache is written at
those slots (`KVCache.device_step`), and attention reads the number of keys in use from the device. The cache's
buffers never move (rollback and eviction change what is in them, not where they are), the model's weights neither.
Nothing in a replay waits for the host; the caller samples from the logits it leaves on the device, and only the
chosen token id comes back.

Every cache format and eviction policy is graphed (an INT4 step quantizes the key groups it touches on the device,
and what the cache keeps on the host is brought up to date after the replay, `KVCache.wrote`; H2O's attention mass
is added by the attention kernel at the slots in use, counted on the device); prefill chunks and blocks longer than
MAX_TOKENS run eagerly, as they do without a GPU.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmrun.kv_cache import DeviceStep, KVCache
from llmrun.sampling import drawn_rows

MAX_TOKENS = 16  # forwards of up to this many tokens (decode steps, verification blocks) are graphed
# A graph's attention spans a power of two of slots, at least this many, covering the keys in use. One attention
# split's worth (`decode_attention.SPLIT_LEN`): up to 256 keys the split kernel then writes its rows itself, where
# a span of 4 splits (3 of them empty) had the last program combine them row after row (T x G rows, serially, in
# every layer: the suspect in a short block's forward costing 1.5-1.9 steps on the H100, 2026-11-28). The same
# bits either way: one split's combine weighs it exp2(0) = 1 and the empty ones 0.
MIN_SPAN = 256
_captures = 0  # graphs captured in this process: a step that captured one took far longer than a replay will


def captures() -> int:
    """How many graphs this process has captured (timers leave out the steps during which this grew)."""
    return _captures


class StagedInputs:
    """A captured step's inputs `device` (3, T) int64: tokens, positions, slots, written before each replay from
    the host through a pinned buffer (a copy from pageable memory may wait for the stream, and a step fed ahead of
    the host with it), which is written again once its last copy has run; tokens drawn on the device are copied in
    there, behind the work that made them, without the host reading them."""

    def __init__(self, device_inputs: torch.Tensor):
        self.device = device_inputs
        cuda = device_inputs.device.type == "cuda"
        self.host = torch.empty(device_inputs.shape, dtype=torch.int64, pin_memory=cuda)
        self.copied = torch.cuda.Event() if cuda else None

    def write(self, values: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
        """values (3, T) int64 on the host, row 0 replaced by `tokens` (T,) on the device where given."""
        if self.copied is not None:
            self.copied.synchronize()  # pipelined decoding enqueues a step while the step before runs, whose copy
            # ran before it started, so this does not wait
        self.host.copy_(values)
        self.device.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if tokens is not None:
            self.device[0].copy_(tokens)


def captured(owner, key, make: Callable[[], object], what: str, instead: str):
    """owner.graphs[key] = make() (a capture), or None where it fails: said once, owner.failed set and its graphs
    let go, so that the caller runs eagerly from then on (whatever broke the capture, the eager path still works)."""
    try:
        graph = owner.graphs[key] = make()
    except Exception as e:  # noqa: BLE001 - any failure of the capture is the finding
        owner.failed = f"{type(e).__name__}: {e}"
        owner.graphs.clear()
        warnings.warn(f"llmrun: capturing {what} as a CUDA graph failed ({owner.failed}); {instead}", RuntimeWarning,
                      stacklevel=3)
        return None
    return graph


@dataclass
class _Graph:
    replay: Callable[[], object]  # runs the captured step again
    inputs: StagedInputs  # what the graph reads
    logits: torch.Tensor  # (1, T, V) fp32 on the device: what the graph writes


def capture(step: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], object], torch.Tensor]:
    """Record `step` as a CUDA graph, after warming it up on a side stream (Triton compiles and autotunes, the
    allocator settles): -> (replay, the output tensor each replay fills)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = step()
    except BaseException:  # a capture that ends in an error leaves its own stream current: the eager steps after
        torch.cuda.set_stream(current)  # it would run there
        raise
    return graph.replay, out


class DecodeGraphs:
    """The CUDA graphs of `model`'s short forwards over one `cache`: one per number of tokens T <= MAX_TOKENS and
    span (the cache slots its attention is handed: a power of two >= MIN_SPAN holding the keys in use, or the
    whole cache), captured at its first use, so attention launches programs for the splits of the keys in use rather
    than for the whole cache. `forward` runs T tokens at a position and slot, as
    `model(tokens, position, cache)` would, and returns their logits (1, T, V)."""

    def __init__(self, model, cache: KVCache):
        self.model, self.cache = model, cache
        self.graphs: dict[tuple[int, int], _Graph] = {}  # (T, span) -> its graph
        # one memory pool for every T: their steps never overlap
        self.pool = torch.cuda.graph_pool_handle() if cache.device.type == "cuda" else None
        self.device = cache.device
        self.failed: str | None = None  # why capturing failed: every forward runs eagerly from then on
        # the RoPE tables, built now for every position the model takes: a replay cannot grow them, and the graphs
        # hold these tensors (should the model ever replace them, the graphs are captured again: `forward`)
        self.tables = model._rope_tables(model.config.max_seq_len, self.device)

    def _step(self, inputs: torch.Tensor, T: int, span: int) -> torch.Tensor:
        """The forward a graph holds: inputs (3, T) on the device -> logits (1, T, V)."""
        tokens, positions, slots = inputs[0].view(1, T), inputs[1], inputs[2]
        length = (slots[-1:] + 1).to(torch.int32)
        self.cache.device_step = DeviceStep(slots, positions, length, span)
        try:
            return self.model(tokens, positions, self.cache)
        finally:
            self.cache.device_step = None

    def _capture(self, staged: torch.Tensor, tokens: torch.Tensor | None, span: int) -> _Graph:
        global _captures
        _captures += 1
        T = staged.shape[1]
        inputs = staged.to(self.device)  # the step being run: the warm-up runs it (writing what it will write)
        if tokens is not None:
            inputs[0].copy_(tokens)
        # The warm-up's writes are the step's own, done again by the replay; H2O's attention mass is added to, so
        # it is put back as it was before the replay adds the step's share once
        mass = None if self.cache.scores is None else self.cache.scores.clone()
        try:
            replay, logits = capture(functools.partial(self._step, inputs, T, span), self.pool)
        finally:  # also when the capture fails: the eager step that runs instead adds the step's share itself
            if mass is not None:
                self.cache.scores.copy_(mass)
        return _Graph(replay, StagedInputs(inputs), logits)

    def forward(self, ids: list[int] | torch.Tensor, position: int, slot: int) -> torch.Tensor | None:
        """Logits (1, T, V) fp32 (a new tensor) of the T = len(ids) tokens at positions position.. written into
        cache slots slot.. (the caller has made room for them); None if the graph could not be captured (said
        once; the caller runs the step eagerly, now and from then on). ids may be a tensor (T,) on the device:
        copied into the graph's inputs there, without the host reading them."""
        T = len(ids)
        if self.failed or T > MAX_TOKENS:
            return None
        if self.model._cos is not self.tables[0]:  # the tables the graphs read were replaced: capture anew
            self.graphs.clear()
            self.tables = self.model._rope_tables(self.model.config.max_seq_len, self.device)
        tokens = ids if torch.is_tensor(ids) else None
        staged = torch.tensor([[0] * T if tokens is not None else ids, range(position, position + T),
                               range(slot, slot + T)], dtype=torch.int64)
        span = min(max(MIN_SPAN, 1 << (slot + T - 1).bit_length()), self.cache.max_len)
        g = self.graphs.get((T, span))
        if g is None:
            g = captured(self, (T, span), lambda: self._capture(staged, tokens, span), "the decode step",
                         "running it eagerly")
            if g is None:
                return None
        g.inputs.write(staged, tokens)
        g.replay()
        self.cache.wrote(slot, T)
        return g.logits.clone()  # the next replay of this T overwrites g.logits


class DrawGraphs:
    """Sampled draws captured as CUDA graphs, one a setting of the filters (temperature, top-k, top-p, min-p) and
    shape of the logits: `sampling.Ahead`'s device work (the top-k survivors, the filters, the inverse-CDF pick and
    its tie and finiteness flags, ~35 small kernels) replayed from a static copy of the logits at a uniform filled in
    before, so a sampled token costs the host one replay instead of ~45 eager operations, and the GPU no gaps between
    them; and sampled verification's (`speculative.verify`, a block of K + 1 <= MAX_TOKENS rows: the blocks that have
    graphs of their own): a row of a block's logits each where the drafts were chosen outright, the rejection rule's
    work (`speculative.decided`) for a model draft's. The same operations on the same values: the same tokens as the
    eager work. A capture that fails is said once, and every draw runs eagerly from then on. Each
    graph has a memory pool of its own, let go with it; past MAX_GRAPHS the least recently used goes."""

    MAX_GRAPHS = 16  # (settings, shape) kept captured at once: a reply's one-token draws and its blocks' lengths

    def __init__(self, device: torch.device):
        self.device = device
        # key -> (replay, its static inputs, its output), least recently used first
        self.graphs: OrderedDict[tuple, tuple[Callable[[], object], tuple[torch.Tensor, ...], torch.Tensor]] = \
            OrderedDict()
        self.failed: str | None = None

    def draw(self, logits: torch.Tensor, params, u: float) -> torch.Tensor | None:
        """(token, exact, finite) int64 (3,) on the device: the draw from logits (V,) at uniform u, as
        `sampling.Ahead` makes it without a graph (a block's rows: `run(sampling.drawn_rows, ...)`). Valid until the
        next draw of these settings (the caller copies it behind, in stream order). None where graphs failed: the
        caller draws eagerly."""
        graph = self._graph((logits.shape, logits.dtype), params, lambda: self._capture(drawn_rows, (logits[None],
                            torch.tensor([[u]], dtype=torch.float64, device=logits.device)), params))
        if graph is None:
            return None
        replay, (source, uniform), out = graph
        source.copy_(logits)
        uniform.fill_(u)  # the value goes as the fill kernel's argument: no copy from the host to wait for
        replay()
        return out[:, 0]

    def run(self, function: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
            params) -> torch.Tensor | None:
        """function(*inputs, params) -> a tensor, device work over the device tensors `inputs` (the rows of a block
        and what decides them: at most MAX_TOKENS rows in the first), replayed from the graph of that function,
        those shapes and dtypes and params' filters, the inputs copied into its own: its output, valid until the
        next run of that graph. None where graphs failed or the block is longer: the caller runs it eagerly."""
        if len(inputs[0]) > MAX_TOKENS:
            return None
        key = (function.__name__, *((t.shape, t.dtype) for t in inputs))
        graph = self._graph(key, params, lambda: self._capture(function, inputs, params))
        if graph is None:
            return None
        replay, statics, out = graph
        for static, value in zip(statics, inputs):
            static.copy_(value)
        replay()
        return out

    def _graph(self, key: tuple, params, capture_it: Callable[[], tuple]) -> tuple | None:
        """The graph of `key` and params' filters, captured by `capture_it` where there is none (the least recently
        used let go past MAX_GRAPHS), or None where graphs failed."""
        if self.failed:
            return None
        key = (*key, params.temperature, params.top_k, params.top_p, params.min_p)
        graph = self.graphs.get(key)
        if graph is None:
            if len(self.graphs) >= self.MAX_GRAPHS:  # many settings or block lengths (a script, a sweep)
                self.graphs.popitem(last=False)
            graph = captured(self, key, capture_it, "the sampled draw", "drawing eagerly")
            if graph is None:
                return None
        self.graphs.move_to_end(key)
        return graph

    @staticmethod
    def _capture(function: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], params) -> tuple:
        global _captures
        _captures += 1  # a decode step or a verification block whose draw captured is no step's typical time
        statics = tuple(t.clone() for t in inputs)
        replay, out = capture(lambda: function(*statics, params), None)
        return replay, statics, out


def for_engine(model, cache: KVCache) -> DecodeGraphs | None:
    """The CUDA graphs for an engine's model and cache, or None: off the GPU, with LLMRUN_NO_CUDA_GRAPHS set, for
    the plain-PyTorch baseline (`--weights dequant`, which stays eager) and for batches; and, with a one-line
    warning, for a float cache in another dtype than the model's (`--kv fp16` beside fp32 weights: its reads are
    cast, which a device step does not do)."""
    if (cache.device.type != "cuda" or os.environ.get("LLMRUN_NO_CUDA_GRAPHS") or getattr(model, "reference_ops", False)
            or cache.shape[1] != 1):
        return None
    dense = cache.dense
    if dense is not None and dense[0].dtype != next(model.parameters()).dtype:
        warnings.warn("llmrun: decode steps run without CUDA graphs: the KV cache's dtype differs from the model's",
                      RuntimeWarning, stacklevel=2)
        return None
    return DecodeGraphs(model, cache)
