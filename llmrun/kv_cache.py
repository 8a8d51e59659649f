"""The KV cache: preallocated static buffers indexed by absolute position.

Static shapes keep the decode step capturable (CUDA graphs, torch.compile); rolling back a rejected
speculation or reusing a chat prefix is moving `length`, never copying tensors.
"""

from __future__ import annotations

import torch

from llmrun.errors import ContextOverflowError


class KVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # per-layer views, made once: indexing the 5-d buffers on every step costs more than the copy
        self._k_layers, self._v_layers = self.k.unbind(0), self.v.unbind(0)
        self.max_len = max_len
        self.length = 0  # positions [0, length) hold valid keys/values

    @classmethod
    def for_model(cls, cfg, max_len: int, dtype, device, batch: int = 1) -> KVCache:
        return cls(cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim, dtype, device)

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, T, Hkv, D) at positions [start, start + T); return views (B, Hkv, start + T, D)."""
        end = start + k.shape[1]
        if end > self.max_len:
            raise ContextOverflowError(f"the KV cache holds {self.max_len} positions; {end} are needed")
        k_layer, v_layer = self._k_layers[layer], self._v_layers[layer]  # (B, Hkv, max_len, D)
        k_layer.narrow(2, start, end - start).copy_(k.transpose(1, 2))
        v_layer.narrow(2, start, end - start).copy_(v.transpose(1, 2))
        return k_layer.narrow(2, 0, end), v_layer.narrow(2, 0, end)

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (rollback): the buffers stay, later writes overwrite them."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def bytes_in_use(self) -> int:
        return self.nbytes * self.length // self.max_len
