"""Reading GGUF files: metadata and tensors, memory-mapped, with clear errors for damaged files.

The header is parsed here (the `gguf` package's reader spends seconds building objects for every vocabulary
entry); the common block types are unpacked in torch (`gguf_quants`), the others by the `gguf` package. GGUF
lists tensor dims fastest-varying first, so a (rows, cols) matrix appears as [cols, rows].
"""

from __future__ import annotations

import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llmrun import gguf_quants
from llmrun.errors import ModelFormatError

_SCALARS = {  # GGUF value type -> struct format
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order: slowest-varying first
    ggml_type: int
    data: np.ndarray  # float32/float16 for F32/F16; raw bytes (uint8, one row of blocks per row) otherwise

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name

    def dequantize(self):
        """Float32 torch tensor of `shape`. The block types of `gguf_quants` are unpacked in torch (the `gguf`
        package's numpy path takes seconds on a small model); the others go through `gguf.quants`."""
        if self.ggml_type in gguf_quants.BLOCK:
            return gguf_quants.dequantize(self.ggml_type, self._rows()).reshape(self.shape)
        with warnings.catch_warnings():  # the memory map is read-only, and only ever read
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.ascontiguousarray(self.to_numpy()))

    @property
    def plane_format(self) -> tuple[int, bool] | None:
        """(bits, with offsets) of the planes `blocks()` gives for this tensor; None when it has none (a vector,
        a float tensor or a block type that cannot be dequantized)."""
        return gguf_quants.plane_format(self.ggml_type) if len(self.shape) == 2 else None

    def blocks(self):
        """The quantized weights as planes (qs, d, m, bits), as `kernels.ref.dequantize_blocks` reads them: the
        file's own bits for Q4_0/Q4_1/Q8_0, a conversion for Q5_0/Q4_K (`gguf_quants`: exact but for fp16
        rounding), the others requantized to 8 bits. m is None for symmetric planes."""
        return gguf_quants.planes(self.ggml_type, self._rows())

    def _rows(self):  # the blocks as a (rows, bytes per row) uint8 tensor viewing the memory map
        with warnings.catch_warnings():  # the memory map is read-only, and only ever read
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self.data)

    def to_numpy(self) -> np.ndarray:
        """Dequantized float32 array of `shape`."""
        from gguf import GGMLQuantizationType, quants

        qtype = GGMLQuantizationType(self.ggml_type)
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return self.data.reshape(self.shape).astype(np.float32, copy=False)
        try:
            with np.errstate(all="ignore"):  # corrupt scales make inf and NaN, which the model's output check names
                out = quants.dequantize(self.data, qtype)
        except NotImplementedError as e:
            raise ModelFormatError(f"tensor {self.name}: GGML type {qtype.name} cannot be dequantized") from e
        return out.reshape(self.shape).astype(np.float32, copy=False)


class GGUFFile:
    """`metadata`: key -> python value; `tensors`: name -> GGUFTensor (views into the memory-mapped file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # ValueError: empty file
            raise ModelFormatError(f"cannot read {self.path}: {e}") from e
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, ValueError, KeyError, OverflowError) as e:
            raise ModelFormatError(f"{self.path} is not a valid GGUF file (truncated or corrupt: {e})") from e

    def _parse(self):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        buf = self._map
        if buf[:4] != b"GGUF":
            raise ModelFormatError(f"{self.path} is not a GGUF file (bad magic bytes)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ModelFormatError(f"{self.path}: unsupported GGUF version {version} (llmrun reads 2 and 3)")
        self._pos = 24
        self.metadata = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        self.metadata_end = self._pos
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self._pos)
            self._pos += 8 * n_dims
            ggml_type, offset = self._unpack("<I"), self._unpack("<Q")
            infos.append((name, tuple(reversed(dims)), ggml_type, offset))
        align = self.metadata.get("general.alignment", 32)
        data_start = -(-self._pos // align) * align
        self.tensors = {}
        for name, shape, ggml_type, offset in infos:
            qtype = GGMLQuantizationType(ggml_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape))
            nbytes = n // block * type_size
            start = data_start + offset
            if start + nbytes > len(buf):
                raise ModelFormatError(
                    f"{self.path} is truncated: tensor {name} ends at byte {start + nbytes}, the file has {len(buf)}"
                )
            dtype = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(qtype, np.uint8)
            count = nbytes // np.dtype(dtype).itemsize
            data = np.frombuffer(buf, dtype=dtype, count=count, offset=start)
            if dtype is np.uint8:  # one row of blocks per output row, as gguf.quants expects
                data = data.reshape(-1, shape[-1] // block * type_size)
            self.tensors[name] = GGUFTensor(name, shape, ggml_type, data)

    def _unpack(self, fmt):
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        s = self._map[self._pos : self._pos + n]
        if len(s) != n:
            raise ValueError("string runs past the end of the file")
        self._pos += n
        return s.decode("utf-8")

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, n = self._unpack("<I"), self._unpack("<Q")
            if item_type == _STRING:
                return [self._string() for _ in range(n)]
            if item_type in _SCALARS:
                fmt = "<" + _SCALARS[item_type]
                size = struct.calcsize(fmt)
                arr = np.frombuffer(self._map, dtype=np.dtype(fmt), count=n, offset=self._pos)
                self._pos += n * size
                return arr.tolist()
            return [self._value(item_type) for _ in range(n)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self._unpack("<" + _SCALARS[vtype])


def write_metadata_only(src: str | Path, dst: str | Path) -> int:
    """Write the GGUF file `src` without its tensors to `dst`: the header and the metadata, the tokenizer with it,
    a few MB where the weights take a hundred (what random weights of a shape take from the embedded model, carried
    to a machine that lacks it). Returns the bytes written."""
    g = GGUFFile(src)
    version, _, n_kv = struct.unpack_from("<IQQ", g._map, 4)
    data = b"GGUF" + struct.pack("<IQQ", version, 0, n_kv) + g._map[24 : g.metadata_end]
    Path(dst).write_bytes(data)
    return len(data)
