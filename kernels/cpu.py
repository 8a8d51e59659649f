"""The CPU fast path: `cpu_kernels.c`, compiled once per machine and loaded with ctypes.

The C file is built with the system's C compiler (`$CC`, else `cc`) at first use and cached under
`$XDG_CACHE_HOME/llmrun/kernels` (default `~/.cache/llmrun/kernels`), keyed by the source, the compiler and
the CPU. Without a compiler, `available()` is False, `unavailable_reason()` says why, and callers keep the
plain-PyTorch path. OpenMP comes from the libgomp PyTorch has already loaded, so both share one thread pool.

Shapes and formats are those of `cpu_kernels.c`; `kernels.ref` defines the same arithmetic in torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from . import ref

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -ffp-contract=off: a product then a sum round twice, as in torch, so dequantizing matches kernels/ref.py bit for bit
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off"]

_reason: str | None = None


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmrun" / "kernels"


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and, on Linux, the CPU's feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def _compile(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp_out), "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp_out, out)  # atomic: a concurrent build never sees a half-written file


@cache
def _lib():
    """The loaded library, or None (with the reason in `_reason`)."""
    global _reason
    if os.environ.get("LLMRUN_NO_CPU_KERNELS"):
        _reason = "disabled by LLMRUN_NO_CPU_KERNELS"
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        _reason = "no C compiler found (install gcc or clang, or set CC)"
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        _reason = f"the C compiler {cc} does not run: {e}"
        return None
    key = hashlib.sha256("\n".join([SOURCE.read_text(), cc, version, " ".join(FLAGS), _cpu_signature()]).encode())
    path = _cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    # a library built here that would not load (a cache on a noexec mount): not built again at every start
    unloadable = path.with_suffix(".unloadable")
    fresh = not path.exists()
    while True:
        if fresh:
            try:
                _compile(cc, path)
            except subprocess.CalledProcessError as e:
                _reason = f"compiling {SOURCE.name} failed: {(e.stderr or '').strip().splitlines()[-1:] or e}"
                return None
            except OSError as e:
                _reason = f"cannot build the CPU kernels in {path.parent}: {e}"
                return None
        try:
            lib = ctypes.CDLL(str(path))
            unloadable.unlink(missing_ok=True)
            break
        except OSError as e:  # a cache on a noexec mount; a cached library cut short is built again, once
            if fresh or unloadable.exists():
                _reason = (f"cannot load the CPU kernels: {e} (on a noexec mount, set XDG_CACHE_HOME to a folder "
                           f"that allows running code)")
                try:
                    unloadable.touch()
                except OSError:
                    pass
                return None
            fresh = True
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.quant_matmul.argtypes = [i, p, p, p, i, i, p, i, p, i]
    lib.quant_dequantize.argtypes = [i, p, p, p, i, p, i, p]
    lib.rms_norm.argtypes = [p, p, ctypes.c_float, i, i, p]
    lib.rope.argtypes = [p, ctypes.c_long, p, p, i, i, i]
    lib.silu_mul.argtypes = [p, p, i, i, i, p]
    L = ctypes.c_long
    lib.attention.argtypes = [p, L, p, p, L, i, i, i, i, i, i, p, L, p]
    lib.attention_int8.argtypes = [p, L, p, p, p, p, L, L, i, i, i, i, i, i, i, p, L, p]
    lib.attention_int4.argtypes = [p, L, p, i, i, i, i, i, i, i, i, p, L, p]
    lib.int4_write.argtypes = [p, p, i, i, i, i, p, p, L]
    lib.quantize_int8.argtypes = [p, i, i, i, p, p]
    lib.decode_layers.argtypes = [p, p, i, i, p, p]
    lib.grid_error.argtypes = [p, p, p, p, L, i, i, ctypes.c_float, p]
    return lib


def available() -> bool:
    return _lib() is not None


def unavailable_reason() -> str | None:
    _lib()
    return _reason


def _check(rc: int, what: str) -> None:
    if rc == -2:
        raise MemoryError(f"{what}: cannot allocate memory")
    if rc:
        raise ValueError(f"{what}: bad arguments (code {rc})")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def quant_matmul(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) fp32 @ W^T -> (..., N) fp32, W (N, K) in blocks (`ref.dequantize_blocks`: qs, d, m, bits).

    With `out` (..., N) given, the product is added to it (a fused residual add) and `out` is returned.
    """
    N, K = qs.shape[0], x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    y = out if out is not None else torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    rc = _lib().quant_matmul(bits, qs.data_ptr(), d.data_ptr(), _ptr(m), N, K, x2.data_ptr(), x2.shape[0],
                             y.data_ptr(), int(out is not None))
    _check(rc, "quant_matmul")
    return y


def quant_rows(ids: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Rows `ids` (...) int64 of W (N, K) in blocks, expanded -> (..., K) fp32 (an embedding lookup)."""
    K = d.shape[1] * 32
    flat = ids.reshape(-1).contiguous()
    out = torch.empty(*ids.shape, K, dtype=torch.float32)
    _check(_lib().quant_dequantize(bits, qs.data_ptr(), d.data_ptr(), _ptr(m), K, flat.data_ptr(), flat.numel(),
                                   out.data_ptr()), "quant_rows")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., K) fp32 contiguous -> x * rsqrt(mean(x^2) + eps) * weight."""
    out = torch.empty_like(x)
    _lib().rms_norm(x.data_ptr(), weight.data_ptr(), eps, x.numel() // x.shape[-1], x.shape[-1], out.data_ptr())
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place: x (1, T, H, D) fp32 rotated by cos/sin (T, D) contiguous ("rotate half"). Returns x.

    x's heads must be contiguous within a token (strides (., ld, D, 1)); tokens may be ld apart."""
    _, T, H, D = x.shape
    _lib().rope(x.data_ptr(), x.stride(1), cos.data_ptr(), sin.data_ptr(), T, H, D)
    return x


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up (..., F) fp32 whose rows are contiguous (they may share a row stride)."""
    F = gate.shape[-1]
    out = torch.empty(*gate.shape[:-1], F, dtype=torch.float32)
    _lib().silu_mul(gate.data_ptr(), up.data_ptr(), out.numel() // F, F, gate.stride(-2) if gate.dim() > 1 else F,
                    out.data_ptr())
    return out


def _mass(mass: torch.Tensor | None) -> tuple[int | None, int]:
    """H2O's accumulator (1, Hkv, S) fp32, rows contiguous -> (pointer, row stride) for the C attention."""
    if mass is None:
        return None, 0
    if mass.dtype != torch.float32 or mass.stride(-1) != 1:
        raise ValueError("the attention mass accumulator must be fp32 with contiguous rows")
    return mass.data_ptr(), mass.stride(1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
              mass: torch.Tensor | None = None) -> torch.Tensor:
    """q (1, T, Hq, D), heads contiguous within a token; k, v (1, Hkv, S, D) with contiguous rows (a KV cache
    view) -> (1, T, Hq, D) contiguous.

    Query t is at key position S - T + t and attends causally (within `window` positions when given).
    mass: None, or (1, Hkv, S) fp32 to which each key's softmax weight is added (`ref.attention_mass`)."""
    _, T, Hq, D = q.shape
    _, Hkv, S, _ = k.shape
    out = torch.empty(1, T, Hq, D, dtype=torch.float32)
    _check(_lib().attention(q.data_ptr(), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(1), T, S, Hq, Hkv, D,
                            window or 0, *_mass(mass), out.data_ptr()), "attention")
    return out


def attention_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                   window: int | None, mass: torch.Tensor | None = None) -> torch.Tensor:
    """`attention` over an int8 cache (`ref.quantize_int8`), reading the codes: q (1, T, Hq, D) as for `attention`;
    k, v int8 (1, Hkv, S, D) and k_scale, v_scale fp16 (1, Hkv, S, D/group), rows contiguous, k and v sharing their
    strides and so do the scales (views of a KV cache) -> (1, T, Hq, D) fp32.

    The codes are never expanded to a copy: a group's scale multiplies q's sum with its codes (keys) or the softmax
    weight before it multiplies them (values), so the result is `attention` over `ref.dequantize_int8` of the codes
    up to a rounding or two. A row's bits do not depend on the rows beside it."""
    _, T, Hq, D = q.shape
    _, Hkv, S, _ = k.shape
    out = torch.empty(1, T, Hq, D, dtype=torch.float32)
    _check(_lib().attention_int8(q.data_ptr(), q.stride(1), k.data_ptr(), v.data_ptr(), k_scale.data_ptr(),
                                 v_scale.data_ptr(), k.stride(1), k_scale.stride(1), T, S, Hq, Hkv, D,
                                 D // k_scale.shape[-1], window or 0, *_mass(mass), out.data_ptr()), "attention_int8")
    return out


class _Int4Cache(ctypes.Structure):  # int4_cache: one layer's INT4 cache, per kv head
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("k_scale", ctypes.c_void_p), ("k_min", ctypes.c_void_p),
                ("v_scale", ctypes.c_void_p), ("v_min", ctypes.c_void_p), ("k_recent", ctypes.c_void_p),
                ("v_recent", ctypes.c_void_p),
                ("code_stride", ctypes.c_long), ("k_scale_stride", ctypes.c_long), ("v_scale_stride", ctypes.c_long),
                ("recent_stride", ctypes.c_long), ("group", ctypes.c_int), ("ring", ctypes.c_int),
                ("window", ctypes.c_int)]


def int4_layout_ok(k, v, k_scale, k_min, v_scale, v_min, k_recent, v_recent) -> bool:
    """Whether one layer's INT4 cache tensors (`ref.QuantizedKV`'s, batch 1, fp32 rings) have the strides the C
    kernels read: rows contiguous, keys and values sharing the codes' head stride (and the rings'), scales and
    minimums theirs."""
    D = k_recent.shape[-1]
    rows = all(t.shape[0] == 1 and t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]
               for t in (k, v, k_scale, k_min, v_scale, v_min, k_recent, v_recent))
    return (rows and k_recent.dtype == v_recent.dtype == torch.float32 and k_recent.shape == v_recent.shape
            and k_recent.stride(1) == v_recent.stride(1)
            and k.stride(1) == v.stride(1) and k.shape[-1] * 2 == D and k_scale.stride(1) == k_min.stride(1)
            and v_scale.stride(1) == v_min.stride(1) and k_scale.shape[-1] == D and D % v_scale.shape[-1] == 0)


def _int4_cache(k, v, k_scale, k_min, v_scale, v_min, k_recent, v_recent) -> _Int4Cache:
    D = k_recent.shape[-1]
    return _Int4Cache(k.data_ptr(), v.data_ptr(), k_scale.data_ptr(), k_min.data_ptr(), v_scale.data_ptr(),
                      v_min.data_ptr(), k_recent.data_ptr(), v_recent.data_ptr(), k.stride(1), k_scale.stride(1),
                      v_scale.stride(1), k_recent.stride(1), D // v_scale.shape[-1], k_recent.shape[-2],
                      ref.ring_window(k_recent.shape[-2]))


def attention_int4(q: torch.Tensor, kv, window: int | None, mass: torch.Tensor | None = None) -> torch.Tensor:
    """`attention` over an INT4 cache (`ref.QuantizedKV` with bits 4, batch 1, `int4_layout_ok`), reading the codes:
    each query row reads the keys `QuantizedKV.row_quantized` gives it. q (1, T, Hq, D) as for `attention` ->
    (1, T, Hq, D) fp32.

    The codes are never expanded to a copy: for key codes of one group, q times the channel scales multiplies the
    codes and q . the channel minimums is added once; value codes take the softmax weight times their scale, and the
    minimums are summed once per group. The result is `attention` over `ref.dequantize_kv(kv, n)` for each row's n
    up to a rounding or two; a row's bits do not depend on the rows beside it."""
    _, T, Hq, D = q.shape
    Hkv, S = kv.k.shape[1], kv.length
    cache = _int4_cache(kv.k, kv.v, kv.k_scale, kv.k_min, kv.v_scale, kv.v_min, kv.k_recent, kv.v_recent)
    out = torch.empty(1, T, Hq, D, dtype=torch.float32)
    _check(_lib().attention_int4(q.data_ptr(), q.stride(1), ctypes.byref(cache), T, S, Hq, Hkv, D, kv.n_quantized,
                                 kv.first_exact, window or 0, *_mass(mass), out.data_ptr()), "attention_int4")
    return out


def int4_write(layer: tuple[torch.Tensor, ...], state: torch.Tensor, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Writes k, v fp32 (1, Hkv, T, D) into slots slot .. slot + T - 1 of one layer's INT4 cache, as
    llmrun/kv_cache.py's store writes them (bit for bit): `layer` = its (k, v, k_scale, k_min, v_scale, v_min,
    k_recent, v_recent) buffers, (1, Hkv, ...) each (`int4_layout_ok`); state int32 (3,) {quantized, exact_from, end},
    updated in place."""
    Hkv, T, D = k.shape[1:]
    tokens = torch.stack((k, v)).transpose(2, 3).contiguous()  # (2, 1, T, Hkv, D): token rows, heads within
    _check(_lib().int4_write(ctypes.byref(_int4_cache(*layer)), state.data_ptr(), Hkv, D, slot, T,
                             tokens[0].data_ptr(), tokens[1].data_ptr(), Hkv * D), "int4_write")


def quantize_int8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) fp32 -> codes int8 (..., D), scales fp16 (..., D/group): `ref.quantize_int8`, bit for bit (the
    decode stack writes an int8 cache with it)."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    codes = torch.empty(*x.shape, dtype=torch.int8)
    scales = torch.empty(*x.shape[:-1], D // group, dtype=torch.float16)
    _check(_lib().quantize_int8(x2.data_ptr(), x2.shape[0], D, group, codes.data_ptr(), scales.data_ptr()),
           "quantize_int8")
    return codes, scales


def grid_error(wg: torch.Tensor, e: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, top: int) -> torch.Tensor:
    """AWQ's weighted rounding error of the groups wg (out, G, g) fp32 on the grids scale, zero (out, G, 1), the
    channels' energies e (1, G, g) -> (out, G): `llmrun.awq._grid_error` in one pass (each operation rounded as
    there; the sum over a group in another order)."""
    out_rows, G, g = wg.shape
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (wg, e, scale, zero)), "fp32 on the CPU"
    assert e.shape == (1, G, g) and scale.shape == zero.shape == (out_rows, G, 1), (e.shape, scale.shape, zero.shape)
    wg, e, scale, zero = (t.contiguous() for t in (wg, e, scale, zero))
    err = torch.empty(out_rows, G, dtype=torch.float32)
    _check(_lib().grid_error(wg.data_ptr(), e.data_ptr(), scale.data_ptr(), zero.data_ptr(), out_rows * G, G, g,
                             float(top), err.data_ptr()), "grid_error")
    return err


class _QLinear(ctypes.Structure):
    _fields_ = [("qs", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("bits", ctypes.c_int), ("N", ctypes.c_int), ("K", ctypes.c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", _QLinear), ("o", _QLinear),
                ("gate_up", _QLinear), ("down", _QLinear), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p), ("int4", _Int4Cache),
                ("int4_state", ctypes.c_void_p), ("scores", ctypes.c_void_p)]


class _Stack(ctypes.Structure):
    _fields_ = [("n_layers", ctypes.c_int), ("dim", ctypes.c_int), ("n_heads", ctypes.c_int), ("n_kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("ffn_dim", ctypes.c_int), ("max_len", ctypes.c_int), ("window", ctypes.c_int),
                ("kv_format", ctypes.c_int), ("kv_group", ctypes.c_int), ("eps", ctypes.c_float),
                ("layers", ctypes.POINTER(_Layer))]


_CACHE_FP32, _CACHE_INT8, _CACHE_INT4 = range(3)  # cpu_kernels.c's cache formats


class DecodeStack:
    """A decode step (or a short speculative block) through all layers in a single C call (`decode_layers`): the
    same kernels in the same order as the layer-by-layer forward, without the Python between them.

    `layers`: per layer a dict of fp32 tensors `attn_norm`, `mlp_norm` (and Qwen3's per-head `q_norm`, `k_norm`,
    or None) and quantized linears `qkv`, `o`, `gate_up`, `down` (objects with `qs`, `d`, `m`, `bits`, `bias`).
    The KV cache, exactly one of:
    - `fp32_kv` = (k, v), fp32 (L, 1, Hkv, max_len, D) each (a dense cache's buffers);
    - `int8_kv` = (codes, scales), int8 (2, L, 1, Hkv, max_len, D) and fp16 (2, L, 1, Hkv, max_len, D/group), keys
      then values along the first dimension (an int8 cache's store: the stack writes codes as `ref.quantize_int8`
      and attends over them);
    - `int4_kv` = (k, v, k_scale, k_min, v_scale, v_min, recent, state): an INT4 cache's store, each buffer
      (L, 1, Hkv, ...) with each layer `int4_layout_ok`, and state int32 (L, 3) {quantized, exact_from, end} per
      layer, which the stack updates as it writes (as `int4_write`).
    `scores`: None, or fp32 (L, 1, Hkv, max_len): H2O's attention mass, to which each step adds its attention's
    (its own slots restarting at 0). Buffers must be contiguous. The tensors must outlive the stack (it holds raw
    pointers; it also keeps references).
    """

    def __init__(self, layers: list[dict], *, fp32_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                 int8_kv: tuple[torch.Tensor, torch.Tensor] | None = None, int4_kv: tuple[torch.Tensor, ...] | None = None,
                 scores: torch.Tensor | None = None, n_heads: int, n_kv_heads: int, head_dim: int, dim: int,
                 ffn_dim: int, eps: float, window: int | None):
        if sum(kv is not None for kv in (fp32_kv, int8_kv, int4_kv)) != 1:
            raise ValueError("DecodeStack takes one KV cache: fp32_kv, int8_kv or int4_kv")
        n, group, no_int4 = len(layers), 0, (_Int4Cache(), None)
        if fp32_kv is not None:
            k_cache, v_cache = fp32_kv
            if k_cache.dtype != torch.float32 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
                raise ValueError("fp32_kv must be two contiguous fp32 (L, 1, Hkv, max_len, D) buffers")
            fmt, max_len = _CACHE_FP32, k_cache.shape[3]
            caches = [(k_cache[i].data_ptr(), v_cache[i].data_ptr(), None, None, *no_int4) for i in range(n)]
        elif int8_kv is not None:
            codes, scales = int8_kv
            formats = codes.dtype == torch.int8 and scales.dtype == torch.float16
            if not (formats and codes.is_contiguous() and scales.is_contiguous()):
                raise ValueError("int8_kv must be contiguous int8 codes and fp16 scales, (2, L, 1, Hkv, max_len, ...)")
            fmt, max_len, group = _CACHE_INT8, codes.shape[4], head_dim // scales.shape[-1]
            caches = [(*(t.data_ptr() for t in (codes[0, i], codes[1, i], scales[0, i], scales[1, i])), *no_int4)
                      for i in range(n)]
        else:
            *buffers, state = int4_kv
            if not (state.dtype == torch.int32 and state.is_contiguous() and state.shape == (n, 3)
                    and all(int4_layout_ok(*(b[i] for b in buffers)) for i in range(n))):
                raise ValueError("int4_kv must be an INT4 cache's (L, 1, Hkv, ...) buffers with contiguous rows and "
                                 "its int32 (L, 3) state")
            fmt, max_len = _CACHE_INT4, buffers[0].shape[3]
            caches = [(None, None, None, None, _int4_cache(*(b[i] for b in buffers)), state[i].data_ptr())
                      for i in range(n)]
        if scores is not None and not (scores.dtype == torch.float32 and scores.is_contiguous()
                                       and scores.shape[-1] == max_len):
            raise ValueError("scores must be a contiguous fp32 (L, 1, Hkv, max_len) buffer")

        def qlinear(w):
            return _QLinear(w.qs.data_ptr(), w.d.data_ptr(), _ptr(w.m), _ptr(w.bias), w.bits, w.qs.shape[0],
                            w.d.shape[1] * 32)

        self._keep = (layers, fp32_kv, int8_kv, int4_kv, scores)
        self._layers = (_Layer * n)(*[
            _Layer(L["attn_norm"].data_ptr(), L["mlp_norm"].data_ptr(), _ptr(L.get("q_norm")), _ptr(L.get("k_norm")),
                   qlinear(L["qkv"]), qlinear(L["o"]),
                   qlinear(L["gate_up"]), qlinear(L["down"]), *cache, None if scores is None else scores[i].data_ptr())
            for i, (L, cache) in enumerate(zip(layers, caches))
        ])
        self._params = _Stack(n, dim, n_heads, n_kv_heads, head_dim, ffn_dim, max_len, window or 0, fmt, group, eps,
                              self._layers)
        self._ref = ctypes.byref(self._params)

    def __call__(self, x: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (1, T, dim) fp32 hidden states of T tokens -> after the last layer (a new tensor); cos/sin (T, D) their
        RoPE angles. Writes their K/V into cache slots pos .. pos+T-1 of every layer (their positions, unless an
        evicting cache has shifted them) and attends over slots [0, pos + T)."""
        x = x.contiguous().clone()
        _check(_lib().decode_layers(self._ref, x.data_ptr(), x.shape[1], pos, cos.data_ptr(), sin.data_ptr()),
               "decode_layers")
        return x
