"""gpt-fast's recipe, the second baseline the GPU path is measured against (`llmrun bench --compare` on CUDA): the
plain-PyTorch model (`--weights dequant`: every op from `kernels.ref`, SDPA attention, float weights) with its decode
step made static — the token, its position and its cache slot in device tensors, the cache written at that slot,
attention masked over the whole cache rather than sliced to the keys in use — and compiled by
`torch.compile(mode="reduce-overhead")`: Inductor's fused kernels, replayed as CUDA graphs.

Like gpt-fast, one compiled step serves every position, so attention always spans the whole cache (`--ctx`) where
llmrun's own graphs span a power of two covering the keys in use (`llmrun.cuda_graphs`). Prefill and verification
blocks run eagerly.
"""

from __future__ import annotations

import torch

from llmrun.cuda_graphs import StagedInputs
from llmrun.kv_cache import DeviceStep, KVCache


class CompiledDecode:
    """The compiled decode step of a plain-PyTorch `model` over a float `cache`, in `DecodeGraphs`' place on an
    Engine: `forward(ids, position, slot)` -> logits (1, 1, V), or None for anything but one token (the caller
    runs those eagerly). `options` go to torch.compile (the tests trace with backend="eager")."""

    def __init__(self, model, cache: KVCache, **options):
        if cache.dense is None or cache.eviction is not None or cache.shape[1] != 1:
            raise ValueError("the compiled baseline needs a float cache of one sequence that holds every token")
        self.model, self.cache = model, cache
        self.failed: str | None = None
        device = cache.device
        self.model._rope_tables(model.config.max_seq_len, device)  # every position's table, built before tracing
        # Written in place at every step: static addresses let the CUDA graph keep them. The per-layer views are
        # what the step reads and writes, hence the traced graph's inputs (the 5-d buffers never appear in it); an
        # input it mutates that is not static makes Inductor skip CUDA graphs ("mutated inputs") and run eagerly.
        for buffer in cache.store.layer_views:
            torch._dynamo.mark_static_address(buffer)
        self.inputs = torch.zeros(3, 1, dtype=torch.int64, device=device)  # token, position, slot
        self.staged = StagedInputs(self.inputs)  # written as the graph runner writes its graphs' inputs
        self.step = DeviceStep(self.inputs[2], self.inputs[1], torch.ones(1, dtype=torch.int32, device=device),
                               cache.max_len)
        self.compiled = torch.compile(self._forward, fullgraph=True, dynamic=False,
                                      **(options or {"mode": "reduce-overhead"}))

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model._forward(tokens, positions, self.cache, False)

    def forward(self, ids: list[int] | torch.Tensor, position: int, slot: int) -> torch.Tensor | None:
        if len(ids) != 1:
            return None
        token = ids if torch.is_tensor(ids) else None  # a token drawn on the device (`Engine.plain_steps`)
        self.staged.write(torch.tensor([[0 if token is not None else ids[0]], [position], [slot]]), token)
        self.step.length.fill_(slot + 1)
        self.cache.device_step = self.step
        try:
            from llmrun import kernels

            with kernels.reference_ops():
                logits = self.compiled(self.inputs[0].view(1, 1), self.inputs[1])
        finally:
            self.cache.device_step = None
        return logits.clone()  # a CUDA graph's output is overwritten by its next replay
