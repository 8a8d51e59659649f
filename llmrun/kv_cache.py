"""The KV cache: preallocated static buffers, in the model's dtype or quantized (INT8, INT4), optionally bounded
by an eviction policy (a sink-and-window cache, or H2O's heavy hitters).

Static shapes keep the decode step capturable (CUDA graphs, torch.compile); rolling back a rejected
speculation or reusing a chat prefix is moving `length`, never copying tensors.

Slots and positions. A token's K/V sit in a slot; without eviction its slot is its position. Eviction drops
tokens and moves the survivors down to free slots at the end, each keeping the position its key was rotated
at, so RoPE distances stay exact: a new token's position is its slot plus `rope_offset` (how many tokens were
dropped). Only when the positions would run past the model's context are the kept keys re-rotated to their
slots (`rope_offset` back to 0), so a chat may go on for ever with a bounded cache.

Formats (`kernels.ref` defines the arithmetic): `int8` stores K and V per token with a scale per 32 channels;
`int4` is KIVI's recipe, values per token and keys per channel over groups of 32 positions, the newest keys in
full precision until their group fills. Attention reads the codes directly (`kernels.quantized_attention`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llmrun import kernels
from llmrun.errors import ContextOverflowError, LlmrunError, UnsupportedModelError, UsageError
from llmrun.kernels import ref

KV_FORMATS = ("fp32", "bf16", "fp16", "int8", "int4")
EVICTION_POLICIES = ("window", "h2o")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def unsupported(cfg, kv_format: str | None) -> str | None:
    """Why a model cannot keep its KV cache in `kv_format`, or None."""
    if kv_format in ("int8", "int4") and cfg.head_dim % 16:
        return (f"an {kv_format} KV cache needs a head size divisible by 16 (a scale covers 16 or 32 channels); this "
                f"model's heads have {cfg.head_dim}: use --kv fp32, bf16 or fp16")
    return None


def format_of(dtype) -> str:
    """The KV format name of a floating-point dtype (the default format: the model's own)."""
    return next((name for name, d in _DTYPES.items() if d == dtype), "fp32")


def bytes_per_token(cfg, kv_format: str) -> int:
    """KV bytes one token takes in every layer, scales included (INT4: its keys' share of a group's scales)."""
    if kv_format in _DTYPES:
        return cfg.kv_bytes_per_token(_DTYPES[kv_format].itemsize)
    D, elems = cfg.head_dim, cfg.n_layers * cfg.n_kv_heads
    if kv_format == "int8":
        per_head = 2 * (D + 2 * D // ref.kv_group(D))
    elif kv_format == "int4":
        g = ref.kv_group(D)
        per_head = (D // 2 + 4 * D // g) + (D // 2 + 4 * D // ref.KEY_GROUP)  # exact: kv_group(D) needs 16 | D
    else:
        raise ValueError(kv_format)
    return elems * per_head


def int4_ring_slots(max_len: int) -> int:
    """The slots of an INT4 cache's rings for a cache of `max_len` tokens: RING, or fewer for a shorter cache."""
    return max(1, min(ref.RING, max_len))


def int4_ring_bytes(cfg, itemsize: int, max_len: int) -> int:
    """The fixed bytes of the rings (exact keys and values, every layer) of an INT4 cache of `max_len` tokens,
    in a dtype of `itemsize` bytes (the model's)."""
    return 2 * int4_ring_slots(max_len) * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize


class _DenseStore:
    """K and V in one floating-point dtype: (L, B, Hkv, C, D) each."""

    def __init__(self, L, B, H, C, D, dtype, device):
        self.k = torch.zeros(L, B, H, C, D, dtype=dtype, device=device)
        self.v = torch.zeros(L, B, H, C, D, dtype=dtype, device=device)
        # per-layer views, made once: indexing the 5-d buffers on every step costs more than the copy
        self._k, self._v = self.k.unbind(0), self.v.unbind(0)

    @property
    def layer_views(self) -> tuple[torch.Tensor, ...]:
        """Every layer's K and V view, through which all reads and writes go: what a traced step takes as inputs."""
        return (*self._k, *self._v)

    def write(self, layer, slot, k, v):  # k, v (B, Hkv, T, D)
        self._k[layer].narrow(2, slot, k.shape[2]).copy_(k)
        self._v[layer].narrow(2, slot, v.shape[2]).copy_(v)

    def write_at(self, layer, slots, k, v):  # slots (T,) consecutive, int64 on the device: no host value read
        kernels.write_dense(k, v, self._k[layer], self._v[layer], slots)

    def rope_write_at(self, layer, slots, qkv, n_heads, cos, sin):  # `KVCache.update_qkv`: -> the rotated q
        return kernels.rope_write_dense(qkv, n_heads, cos, sin, self._k[layer], self._v[layer], slots)

    def read(self, layer, length):
        return self._k[layer].narrow(2, 0, length), self._v[layer].narrow(2, 0, length)

    read_at = read  # a device step's read over `capacity` slots: attention counts the ones in use

    def wrote(self, slot, n):  # after a device step: nothing kept on the host to bring up to date
        pass

    def truncate(self, length):
        pass

    def keys(self, layer, length):
        return self._k[layer][:, :, :length].float()

    def set_keys(self, layer, k):
        self._k[layer][:, :, : k.shape[2]].copy_(k)

    def keep(self, layer, length, index):
        """Move slots `index` (B, Hkv, n), increasing, to slots [0, n)."""
        for buf in (self._k[layer], self._v[layer]):
            buf[:, :, : index.shape[2]] = _gather(buf[:, :, :length], index)

    @property
    def nbytes(self):
        return self.k.nbytes + self.v.nbytes


class _Int8Store:
    """Codes int8 (L, B, Hkv, C, D) and fp16 scales (L, B, Hkv, C, D/group) for K and for V."""

    def __init__(self, L, B, H, C, D, dtype, device):
        self.group = ref.kv_group(D)
        self.dtype = dtype
        self.codes = torch.zeros(2, L, B, H, C, D, dtype=torch.int8, device=device)  # [k, v]
        self.scales = torch.zeros(2, L, B, H, C, D // self.group, dtype=torch.float16, device=device)

    def write(self, layer, slot, k, v):
        if kernels.triton_serves(k):  # the fused kernel, as a CUDA graph's step writes: the same bits either way
            self.write_at(layer, torch.arange(slot, slot + k.shape[2], device=k.device), k, v)
            return
        for i, x in enumerate((k, v)):
            codes, scale = ref.quantize_int8(x, self.group)
            self.codes[i, layer, :, :, slot : slot + x.shape[2]] = codes
            self.scales[i, layer, :, :, slot : slot + x.shape[2]] = scale

    def write_at(self, layer, slots, k, v):  # slots consecutive
        kernels.write_int8_pair(k, v, self.codes[:, layer], self.scales[:, layer], slots)

    def rope_write_at(self, layer, slots, qkv, n_heads, cos, sin):
        return kernels.rope_write_int8(qkv, n_heads, cos, sin, self.codes[:, layer], self.scales[:, layer], slots)

    def read(self, layer, length):
        c, s = self.codes[:, layer, :, :, :length], self.scales[:, layer, :, :, :length]
        return ref.QuantizedKV(8, c[0], c[1], s[0], s[1]), None

    read_at = read
    wrote = _DenseStore.wrote

    def truncate(self, length):
        pass

    def keys(self, layer, length):
        return ref.dequantize_int8(self.codes[0, layer, :, :, :length], self.scales[0, layer, :, :, :length])

    def set_keys(self, layer, k):
        codes, scale = ref.quantize_int8(k, self.group)
        self.codes[0, layer, :, :, : k.shape[2]] = codes
        self.scales[0, layer, :, :, : k.shape[2]] = scale

    def keep(self, layer, length, index):
        n = index.shape[2]
        for buf in (self.codes[:, layer], self.scales[:, layer]):  # (2, B, Hkv, C, ...)
            for i in range(2):
                buf[i, :, :, :n] = _gather(buf[i, :, :, :length], index)

    @property
    def nbytes(self):
        return self.codes.nbytes + self.scales.nbytes


class _Int4Store:
    """KIVI: values per token (packed codes (L, B, Hkv, C, D/2), fp16 scale and minimum per group of channels);
    keys per channel over groups of KEY_GROUP positions (packed codes, fp16 scale and minimum (L, B, Hkv, C/32,
    D)). A key group is quantized when it fills. The rings `k_recent` and `v_recent` (L, B, Hkv, R, D), R =
    min(RING, C), keep in the model's dtype the exact keys and values of the last `window` = min(RECENT, C)
    positions, which the partial group's (and a prompt chunk's) queries read, and from which a rollback re-fills a
    partial group exactly as it was; their ROLLBACK slots more keep those positions whole under a write of up to
    ROLLBACK tokens that is then rolled back, so that the cache reads as if it had never been written.
    `state` (L, 3) int32, per layer {quantized, exact_from, end}: keys [0, quantized) are codes, the keys and values
    [exact_from, end) are exact in the rings; what is read exact is the part of them in the window. On the CPU in
    fp32 the C kernels write (`kernels.cpu.int4_write`, the same bits as the torch code here, which serves
    elsewhere), and so does the C decode stack, which updates `state` itself."""

    def __init__(self, L, B, H, C, D, dtype, device):
        self.group, G = ref.kv_group(D), ref.KEY_GROUP
        self.k = torch.zeros(L, B, H, C, D // 2, dtype=torch.uint8, device=device)
        self.k_scale = torch.zeros(L, B, H, -(-C // G), D, dtype=torch.float16, device=device)
        self.k_min = torch.zeros_like(self.k_scale)
        self.v = torch.zeros(L, B, H, C, D // 2, dtype=torch.uint8, device=device)
        self.v_scale = torch.zeros(L, B, H, C, D // self.group, dtype=torch.float16, device=device)
        self.v_min = torch.zeros_like(self.v_scale)
        self.ring = int4_ring_slots(C)
        self.window = ref.ring_window(self.ring)  # the positions read exact: [end - window, end), at most
        self.k_recent = torch.zeros(L, B, H, self.ring, D, dtype=dtype, device=device)
        self.v_recent = torch.zeros_like(self.k_recent)
        self.state = torch.zeros(L, 3, dtype=torch.int32)  # on the host: indices, not data
        # each layer's buffers as the C kernels take them, made once (they never move); None where the C kernels
        # cannot write them (a batch, rings in another dtype)
        views = [tuple(b[layer] for b in self.buffers) for layer in range(L)]
        c_writes = B == 1 and dtype == torch.float32 and all(kernels.cpu.int4_layout_ok(*v) for v in views)
        self._c_layers = views if c_writes else None

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """(k, v, k_scale, k_min, v_scale, v_min, k_recent, v_recent): the order `kernels.cpu` takes them in."""
        return self.k, self.v, self.k_scale, self.k_min, self.v_scale, self.v_min, self.k_recent, self.v_recent

    def _state(self, layer) -> tuple[int, int, int]:
        quantized, exact_from, end = self.state[layer].tolist()
        return quantized, exact_from, end

    def _recent_index(self, start, end):
        return torch.arange(start, end, device=self.k_recent.device) % self.ring

    def _exact(self, layer, start, end) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [start, end) fp32, from the rings where they hold them within the window, else from their
        codes."""
        cut = min(max(start, self._state(layer)[1], end - self.window), end)
        keys, values = [], []
        if cut > start:  # below the rings: the key groups are quantized, and every value is
            g0 = start // ref.KEY_GROUP
            keys.append(ref.dequantize_int4_channels(self.k[layer, :, :, g0 * ref.KEY_GROUP : cut],
                                                     self.k_scale[layer, :, :, g0:], self.k_min[layer, :, :, g0:])
                        [:, :, start - g0 * ref.KEY_GROUP :])
            values.append(ref.dequantize_int4_tokens(self.v[layer, :, :, start:cut], self.v_scale[layer, :, :, start:cut],
                                                     self.v_min[layer, :, :, start:cut]))
        if end > cut:
            index = self._recent_index(cut, end)
            keys.append(self.k_recent[layer][:, :, index].float())
            values.append(self.v_recent[layer][:, :, index].float())
        return tuple(torch.cat(parts, dim=2) if len(parts) != 1 else parts[0] for parts in (keys, values))

    def _write_exact(self, layer, slot, k, v):
        """Keys and values (B, Hkv, T, D) at [slot, slot + T) into the rings, and the key groups they fill as codes."""
        G = ref.KEY_GROUP
        _, exact_from, last_end = self._state(layer)
        end = slot + k.shape[2]
        g0 = slot // G * G
        if slot > g0:  # the partial group's first keys: the [g0, end) segment is what gets quantized
            head_k, head_v = self._exact(layer, g0, slot)
            k, v = torch.cat((head_k, k.float()), dim=2), torch.cat((head_v, v.float()), dim=2)
        full = end // G * G
        if full > g0:
            codes, scale, lo = ref.quantize_int4_channels(k[:, :, : full - g0])
            self.k[layer, :, :, g0:full] = codes
            self.k_scale[layer, :, :, g0 // G : full // G] = scale
            self.k_min[layer, :, :, g0 // G : full // G] = lo
        lossy = slot < exact_from or slot > last_end
        start = max(g0 if lossy else slot, end - self.ring)
        index = self._recent_index(start, end)
        self.k_recent[layer][:, :, index] = k[:, :, start - g0 :].to(self.k_recent.dtype)
        self.v_recent[layer][:, :, index] = v[:, :, start - g0 :].to(self.v_recent.dtype)
        self.state[layer] = torch.tensor([full, max(start if lossy else exact_from, end - self.ring), end])

    def write(self, layer, slot, k, v):
        if self._c_layers is not None and kernels.cpu_kernels_serve(k):
            kernels.cpu.int4_write(self._c_layers[layer], self.state[layer], slot, k, v)
            return
        if kernels.triton_serves(k) and slot % ref.KEY_GROUP + k.shape[2] <= self.ring \
                and slot == self._state(layer)[2]:
            # the fused kernels, as a CUDA graph's step writes (decode steps, verification blocks, and prompt chunks,
            # whose torch path below launched ~55 kernels a layer): the same bits
            self.write_at(layer, torch.arange(slot, slot + k.shape[2], device=k.device), k, v)
            self.wrote(slot, k.shape[2], layer)
            return
        codes, scale, lo = ref.quantize_int4_tokens(v, self.group)
        T = v.shape[2]
        self.v[layer, :, :, slot : slot + T], self.v_scale[layer, :, :, slot : slot + T] = codes, scale
        self.v_min[layer, :, :, slot : slot + T] = lo
        self._write_exact(layer, slot, k, v)

    def write_at(self, layer, slots, k, v):
        """A write of T new tokens at consecutive slots (T,) on the device, right after the tokens in use (a device
        step's, `DeviceStep`, or a prompt chunk's through `write`), with no host value read (`kernels.write_int4`:
        a key group is quantized from the rings at each write until the one that fills it). The host's `state` is
        for `wrote` to bring up to date."""
        kernels.write_int4(k, v, *(b[layer] for b in self.buffers), slots=slots)

    def wrote(self, slot, n, layer=slice(None)):
        """The host's `state` of `layer` (default every layer) after `write_at` wrote n tokens at slots
        [slot, slot + n), which follow the tokens in use (what `write` would have made it). A state already past
        `slot` is one a forward cut short by Ctrl-C advanced: the rings hold the positions before `slot` still."""
        end = slot + n
        state = self.state[layer].view(-1, 3)
        assert ((state[:, 1] <= slot) & (slot <= state[:, 2])).all(), "a device step writes after the tokens in use"
        state[:, 0] = end // ref.KEY_GROUP * ref.KEY_GROUP
        state[:, 1] = state[:, 1].clamp(min=end - self.ring)
        state[:, 2] = end

    def read_at(self, layer, capacity):
        """The first `capacity` slots. As a device step's read, n_quantized and first_exact stay 0: the kernel counts
        them from the device-side length (`kernels.quantized_attention`)."""
        return ref.QuantizedKV(4, self.k[layer, :, :, :capacity], self.v[layer, :, :, :capacity], self.k_scale[layer],
                               self.v_scale[layer, :, :, :capacity], self.k_min[layer],
                               self.v_min[layer, :, :, :capacity], self.k_recent[layer], self.v_recent[layer]), None

    def read(self, layer, length):
        G = ref.KEY_GROUP
        quantized, exact_from, _ = self._state(layer)
        nq = min(quantized, length // G * G)
        # a block's queries may read exact keys from the first group start where the rings hold them all: not before
        # exact_from (a rollback past the rings lost the older ones), nor more than the window back
        first_exact = min(nq, -(-max(exact_from, length - self.window) // G) * G)
        return dataclasses.replace(self.read_at(layer, length)[0], n_quantized=nq, first_exact=first_exact), None

    def truncate(self, length):
        g = length // ref.KEY_GROUP * ref.KEY_GROUP
        for layer in range(self.state.shape[0]):
            quantized, exact_from, end = self._state(layer)
            if length >= end:
                continue
            if exact_from > g:  # the partial group's first positions left the rings: take their codes
                if length > g:
                    keys, values = self._exact(layer, g, length)
                    index = self._recent_index(g, length)
                    self.k_recent[layer][:, :, index] = keys.to(self.k_recent.dtype)
                    self.v_recent[layer][:, :, index] = values.to(self.v_recent.dtype)
                exact_from = g
            self.state[layer] = torch.tensor([min(quantized, g), exact_from, length])

    def keys(self, layer, length):
        return self._exact(layer, 0, length)[0]

    def set_keys(self, layer, k):
        values = self._exact(layer, 0, k.shape[2])[1]
        self.state[layer] = 0
        self._write_exact(layer, 0, k, values)

    def keep(self, layer, length, index):
        keys, values = (_gather(x, index) for x in self._exact(layer, 0, length))
        n = index.shape[2]
        for buf in (self.v[layer], self.v_scale[layer], self.v_min[layer]):
            buf[:, :, :n] = _gather(buf[:, :, :length], index)
        self.state[layer] = 0
        self._write_exact(layer, 0, keys, values)  # key groups formed anew: quantized afresh

    @property
    def nbytes(self):
        return sum(t.nbytes for t in self.buffers)


def _gather(x, index):
    """x (B, Hkv, S, ...) -> (B, Hkv, n, ...) at slots index (B, Hkv, n)."""
    return x.gather(2, index.view(*index.shape, *([1] * (x.dim() - 3))).expand(*index.shape, *x.shape[3:]))


@dataclass(frozen=True)
class Eviction:
    """A bounded cache. `window`: the first `sinks` tokens and the most recent ones (StreamingLLM). `h2o`: the sinks,
    a recent window of half the rest, and the tokens that received the most attention so far (Heavy-Hitter
    Oracle), chosen per layer and kv head."""

    policy: str
    budget: int  # the most tokens the cache holds
    sinks: int = 4

    def __post_init__(self):
        if self.policy not in EVICTION_POLICIES:
            raise LlmrunError(f"unknown eviction policy {self.policy!r}; choose {' or '.join(EVICTION_POLICIES)}")
        if self.sinks < 0:
            raise UsageError(f"--kv-sinks must be >= 0, not {self.sinks}")
        if self.budget < self.least_budget:
            raise UsageError(f"--kv-budget {self.budget} is too small; give at least {self.least_budget} "
                              f"tokens (4 x --kv-sinks, and at least 64)")

    @property
    def least_budget(self) -> int:
        """The smallest budget these sinks allow."""
        return max(64, 4 * self.sinks)

    @property
    def max_write(self) -> int:
        """The most tokens one forward may add (longer prompts are fed in pieces this long)."""
        return self.budget // 4

    @property
    def slack(self) -> int:
        """Eviction frees this many slots beyond what the next write needs, so it runs once per `slack` tokens."""
        return max(1, self.budget // 8)


@dataclass(frozen=True)
class DeviceStep:
    """A forward whose positions live on the device, so that one CUDA graph of it replays at any position
    (`llmrun.cuda_graphs`): while `KVCache.device_step` holds one, `update` writes the T new tokens' K/V at `slots`
    and hands attention the buffers' first `capacity` slots with `length`, the slots in use, which attention reads on
    the device.
    Every format and eviction policy (H2O's attention mass is added at `slots` and the slots in use); after the
    step, `KVCache.wrote` updates what the cache keeps on the host."""

    slots: torch.Tensor  # (T,) int64: where the tokens' K/V go
    positions: torch.Tensor  # (T,) int64: their RoPE positions
    length: torch.Tensor  # (1,) int32: slots in use once they are written
    capacity: int  # the slots attention is handed, a bound fixed for the graph: length <= capacity <= max_len


class KVCache:
    """K/V of `batch` sequences for every layer, `max_len` slots (the eviction budget when there is one).

    `kv_format`: one of KV_FORMATS (default: `dtype`, the model's). `eviction`: an `Eviction`, or None for a cache
    that holds every token and refuses more than `max_len`. `max_position`: the model's context (RoPE positions
    stay below it; needed with eviction). `length` counts the slots in use; `seen` the tokens written (length plus
    those evicted)."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype, device,
                 kv_format: str | None = None, eviction: Eviction | None = None, max_position: int | None = None):
        kv_format = kv_format or format_of(dtype)
        if kv_format not in KV_FORMATS:
            raise LlmrunError(f"unknown KV cache format {kv_format!r}; choose one of {', '.join(KV_FORMATS)}")
        if eviction is not None:
            max_len = eviction.budget
        self.format, self.eviction = kv_format, eviction
        self.device = torch.empty(0, device=device).device  # with its index: "cuda" is "cuda:0", as tensors say
        self.shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        store = {"int8": _Int8Store, "int4": _Int4Store}.get(kv_format, _DenseStore)
        self.store = store(*self.shape, _DTYPES.get(kv_format, dtype), device)
        self.max_len = max_len
        self.max_position = max_position
        self.length = 0  # slots [0, length) hold valid keys/values
        self.evicted = 0  # tokens dropped by eviction
        self.rope_offset = 0  # a new token's position is its slot + rope_offset
        self.horizon = 0  # tokens seen at the latest eviction: a rollback may go back to here, no further
        self.positions = self.scores = None
        if eviction is not None:
            self.positions = torch.zeros(n_layers, batch, n_kv_heads, max_len, dtype=torch.int64, device=device)
            if eviction.policy == "h2o":
                self.scores = torch.zeros(n_layers, batch, n_kv_heads, max_len, dtype=torch.float32, device=device)
        self._rope = None  # positions (...) -> cos, sin (..., D): set by `for_model`, used to re-rotate keys
        self.device_step: DeviceStep | None = None  # set around a forward captured in a CUDA graph

    @classmethod
    def for_model(cls, model, max_len: int, dtype, device, batch: int = 1, kv_format: str | None = None,
                  eviction: Eviction | None = None) -> KVCache:
        cfg = model.config if hasattr(model, "config") else model
        if eviction is not None and cfg.sliding_window is not None:
            raise LlmrunError("--kv-evict cannot be used with a model that has its own sliding-window attention")
        if (why := unsupported(cfg, kv_format)) is not None:
            raise UnsupportedModelError(why)
        cache = cls(cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim, dtype, device, kv_format, eviction,
                    cfg.max_seq_len)
        cache._rope = getattr(model, "rope_at", None)
        return cache

    # --- what the model calls ---------------------------------------------------------------------------------

    @property
    def dense(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (L, B, Hkv, max_len, D) K and V buffers of a cache in a plain dtype, else None."""
        return (self.store.k, self.store.v) if isinstance(self.store, _DenseStore) else None

    def slot(self, position: int) -> int:
        return position - self.rope_offset

    def update(self, layer: int, position: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, T, Hkv, D) of the tokens at positions [position, position + T) into the next slots.

        Returns what attention reads, the slots [0, end): (k, v) views (B, Hkv, end, D) for a plain cache, or
        (`kernels.ref.QuantizedKV`, None); and the (B, Hkv, end) accumulator H2O's attention mass goes to (or None).
        """
        if self.device_step is not None:
            return self._update_at(layer, k, v)
        slot = self.slot(position)
        end = slot + k.shape[1]
        if end > self.max_len:
            raise ContextOverflowError(f"the KV cache holds {self.max_len} positions; {end} are needed")
        self.store.write(layer, slot, k.transpose(1, 2), v.transpose(1, 2))
        self.record_positions(position, k.shape[1], layer)
        mass = None
        if self.scores is not None:
            self.scores[layer, :, :, slot:end] = 0
            mass = self.scores[layer, :, :, :end]
        k_read, v_read = self.store.read(layer, end)
        if v_read is not None and k_read.dtype != k.dtype:  # a float cache in another dtype (--kv fp16 on fp32)
            k_read, v_read = k_read.to(k.dtype), v_read.to(k.dtype)
        return k_read, v_read, mass

    def update_qkv(self, layer: int, position: int, qkv: torch.Tensor, n_heads: int, cos, sin):
        """RoPE, then `update`: qkv (B, T, n_heads + 2 Hkv, D) the fused projection of the tokens at positions
        [position, position + T), its q and k heads rotated by cos/sin (T, D), k and v written. Returns (the rotated q
        (B, T, n_heads, D), then what `update` returns). A CUDA graph's step over a float cache rotates and writes
        in one launch (`kernels.rope_write_dense`), and so does one over an INT8 cache (`kernels.rope_write_int8`): a
        launch fewer a layer."""
        Hkv = self.shape[2]
        step = self.device_step
        if step is not None and isinstance(self.store, (_DenseStore, _Int8Store)):
            q = self.store.rope_write_at(layer, step.slots, qkv, n_heads, cos, sin)
            return (q, *self._written_at(layer, qkv.dtype))
        qk = kernels.apply_rope(qkv[:, :, : n_heads + Hkv], cos, sin)  # q and k heads in one pass
        return (qk[:, :, :n_heads], *self.update(layer, position, qk[:, :, n_heads:], qkv[:, :, n_heads + Hkv :]))

    def _update_at(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """`update` at `device_step`'s slots."""
        self.store.write_at(layer, self.device_step.slots, k.transpose(1, 2), v.transpose(1, 2))
        return self._written_at(layer, k.dtype)

    def _written_at(self, layer: int, dtype: torch.dtype):
        """After K and V in `dtype` were written at `device_step`'s slots: their positions (eviction) and H2O's mass
        noted; returns the buffers' first `capacity` slots (attention reads `length`)."""
        step = self.device_step
        if self.positions is not None:
            B, H = self.shape[1:3]
            self.positions[layer].index_copy_(2, step.slots, step.positions.expand(B, H, -1))
        mass = None
        if self.scores is not None:  # H2O: the new tokens' mass starts at 0; attention adds to the slots in use
            self.scores[layer].index_fill_(2, step.slots, 0)
            mass = self.scores[layer, :, :, : step.capacity]
        k_read, v_read = self.store.read_at(layer, step.capacity)
        if v_read is not None and k_read.dtype != dtype:
            raise ValueError("a device step needs the cache in the compute dtype")
        return k_read, v_read, mass

    def wrote(self, slot: int, n: int) -> None:
        """After a device step (a CUDA graph's replay, which runs no Python) wrote n tokens at slots [slot, slot + n):
        bring what the cache keeps on the host up to date (INT4's per-layer state; `length` is the caller's)."""
        self.store.wrote(slot, n)

    def contents(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values (B, Hkv, length, D) fp32 that attention reads in `layer` (for tests and checks)."""
        k, v = self.store.read(layer, self.length)
        return ref.dequantize_kv(k) if v is None else (k.float(), v.float())

    def record_positions(self, position: int, n: int, layer: int | slice = slice(None)) -> None:
        """Note that the n tokens from `position` on sit in their slots (of `layer`, default every layer): a writer
        that bypasses `update` (the CPU's one-call decode stack) calls this. Eviction and re-rotation need it."""
        if self.positions is not None:
            slot = self.slot(position)
            self.positions[layer, :, :, slot : slot + n] = torch.arange(position, position + n,
                                                                         device=self.positions.device)

    # --- what the engine calls --------------------------------------------------------------------------------

    @property
    def seen(self) -> int:
        return self.length + self.evicted

    @property
    def position(self) -> int:
        """The RoPE position of the next token."""
        return self.length + self.rope_offset

    def make_room(self, n: int) -> None:
        """Before writing n tokens: evict (with a policy) so they fit, and re-rotate the keys if positions would
        run past the model's context. Without eviction, raise ContextOverflowError when they do not fit."""
        if self.eviction is None:
            if self.length + n > self.max_len:
                raise ContextOverflowError(f"the KV cache holds {self.max_len} positions; {self.length + n} are needed")
            return
        if n > self.eviction.max_write:
            raise ValueError(f"{n} tokens in one write; an evicting cache takes at most {self.eviction.max_write}")
        if self.length + n > self.max_len:
            self._evict(self.max_len - n - self.eviction.slack)
        if self.max_position is not None and self.position + n > self.max_position:
            self._renumber()

    def writes_freely(self, n: int) -> bool:
        """Whether n tokens fit as the cache stands: `make_room(n)` would neither evict nor renumber, so the write can
        be truncated away again without a trace (a forward fed ahead of the host: `Engine.plain_steps`)."""
        renumbers = (self.eviction is not None and self.max_position is not None
                     and self.position + n > self.max_position)
        return self.length + n <= self.max_len and not renumbers

    def truncate(self, seen: int) -> None:
        """Forget every token from the `seen`-th on (rollback): the buffers stay, later writes overwrite them."""
        if not self.can_truncate(seen):
            raise ValueError(f"cannot truncate a cache of {self.seen} tokens to {seen} (eviction ran at {self.horizon})")
        self.length = seen - self.evicted
        self.store.truncate(self.length)

    def can_truncate(self, seen: int) -> bool:
        """Whether `truncate(seen)` is possible: it must not reach back past the latest eviction."""
        return self.horizon <= seen <= self.seen

    def reset(self) -> None:
        self.length = self.evicted = self.rope_offset = self.horizon = 0
        self.store.truncate(0)

    # --- eviction ---------------------------------------------------------------------------------------------

    def _evict(self, keep: int) -> None:
        """Keep `keep` tokens per layer and kv head, as the policy chooses; move them to slots [0, keep)."""
        ev, S = self.eviction, self.length
        sinks = min(ev.sinks, keep)
        L, B, H = self.shape[:3]
        device = self.positions.device
        if ev.policy == "window":
            chosen = torch.cat((torch.arange(sinks, device=device), torch.arange(S - (keep - sinks), S, device=device)))
            index = chosen.expand(L, B, H, keep)
        else:
            recent = (keep - sinks) // 2
            middle = self.scores[:, :, :, sinks : S - recent]  # (L, B, H, candidates): heavy hitters among these
            heavy = middle.topk(keep - sinks - recent, dim=-1).indices.sort(dim=-1).values + sinks
            fixed = torch.arange(S - recent, S, device=device).expand(L, B, H, recent)
            index = torch.cat((torch.arange(sinks, device=device).expand(L, B, H, sinks), heavy, fixed), dim=-1)
        for layer in range(L):
            self.store.keep(layer, S, index[layer])
            self.positions[layer, :, :, :keep] = _gather(self.positions[layer, :, :, :S], index[layer])
            if self.scores is not None:
                self.scores[layer, :, :, :keep] = _gather(self.scores[layer, :, :, :S], index[layer])
        self.evicted += S - keep
        self.rope_offset += S - keep
        self.length = keep
        self.horizon = self.seen

    def _renumber(self) -> None:
        """Re-rotate every kept key from its position to its slot, and restart positions at the slots."""
        if self._rope is None:
            raise ContextOverflowError("this cache cannot re-rotate its keys (no RoPE tables were given)")
        S = self.length
        slots = torch.arange(S, device=self.positions.device)
        for layer in range(self.shape[0]):
            delta = slots - self.positions[layer, :, :, :S]  # (B, Hkv, S): <= 0
            cos, sin = self._rope(delta)  # (B, Hkv, S, D)
            k = self.store.keys(layer, S)
            half = k.shape[-1] // 2
            rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
            self.store.set_keys(layer, k * cos + rotated * sin)
            self.positions[layer, :, :, :S] = slots
        self.rope_offset = 0
        self.horizon = self.seen

    # --- memory -----------------------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        extra = sum(t.nbytes for t in (self.positions, self.scores) if t is not None)
        return self.store.nbytes + extra

    def bytes_in_use(self) -> int:
        return self.nbytes * self.length // self.max_len

    def fp16_equivalent(self) -> int:
        """What the tokens in use would take in a 16-bit cache: the baseline of the compression ratio."""
        L, B, H, _, D = self.shape
        return 2 * L * B * H * D * 2 * self.length
