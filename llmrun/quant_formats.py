"""Group-quantized matrices and the checkpoint layouts that carry them: AutoAWQ's GEMM layout (INT4 with zero
points) and GPTQ's (what `llmrun quantize --int8` writes), packing and unpacking, and the conversion to the
kernels' 32-column blocks (`models.quant`).

A `GroupQuant` is W (out, in) stored as unsigned codes with one scale and one integer zero point per group of
`group` consecutive input columns: W[o, i] = scales[o, g] * (codes[o, i] - zeros[o, g]), g = i // group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmrun.errors import ModelFormatError, UnsupportedModelError

# AutoAWQ packs 8 output columns per int32 in this order: nibble i holds column AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(c) for c in range(8))  # column c sits in nibble AWQ_REVERSE_ORDER[c]


@dataclass
class GroupQuant:
    codes: torch.Tensor  # (out, in) uint8, values 0 .. 2^bits - 1
    scales: torch.Tensor  # (out, in / group) fp16
    zeros: torch.Tensor  # (out, in / group) uint8 integer zero points
    bits: int
    group: int

    def dequantize(self) -> torch.Tensor:
        """-> W (out, in) fp32."""
        s = self.scales.float().repeat_interleave(self.group, dim=1)
        z = self.zeros.float().repeat_interleave(self.group, dim=1)
        return s * (self.codes.float() - z)

    def rows(self, start: int, end: int) -> GroupQuant:
        """Output rows [start, end): a fused projection's part."""
        return GroupQuant(self.codes[start:end], self.scales[start:end], self.zeros[start:end], self.bits, self.group)

    def planes(self):
        """The kernels' planes (qs, d, m, bits) holding exactly these weights (the 4-bit offset m = -zero * scale
        rounded to fp16), or None when no block format fits: groups that are not whole blocks of 32, or 8-bit
        codes whose zero point is not 128 (the 8-bit blocks are symmetric)."""
        from llmrun.models.quant import pack_nibbles

        if self.group % 32:
            return None
        per_block = self.group // 32
        d = self.scales.half().repeat_interleave(per_block, dim=1)  # (out, in / 32)
        if self.bits == 4:
            m = (-self.zeros.float() * self.scales.float()).half().repeat_interleave(per_block, dim=1)
            return pack_nibbles(self.codes), d, m, 4
        if self.bits == 8 and bool((self.zeros == 128).all()):
            return (self.codes.to(torch.int16) - 128).to(torch.int8), d, None, 8
        return None


def _pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., 32 / bits) codes -> (...) int32, value j in bits [j * bits, (j + 1) * bits)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    word = (values.to(torch.int64) << shifts).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the same 32 bits, signed


def _unpack_int32(words: torch.Tensor, bits: int) -> torch.Tensor:
    """(...) int32 -> (..., 32 / bits) codes as uint8, value j from bits [j * bits, (j + 1) * bits)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    return ((words[..., None] >> shifts) & (2**bits - 1)).to(torch.uint8)


# --- AutoAWQ GEMM: qweight (in, out/8) int32, qzeros (in/group, out/8) int32, scales (in/group, out) fp16 -----


def pack_awq(q: GroupQuant) -> dict[str, torch.Tensor]:
    if q.bits != 4:
        raise ValueError("the AWQ GEMM layout holds 4-bit codes")

    def pack(t):  # (rows, out) -> (rows, out / 8): each word holds 8 output columns in AWQ_ORDER
        rows, out = t.shape
        return _pack_int32(t.reshape(rows, out // 8, 8)[..., list(AWQ_ORDER)], 4)

    return {"qweight": pack(q.codes.T), "qzeros": pack(q.zeros.T), "scales": q.scales.T.half().contiguous()}


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> GroupQuant:
    def unpack(t):  # (rows, out / 8) -> (out, rows)
        nibbles = _unpack_int32(t, 4)[..., list(AWQ_REVERSE_ORDER)]  # (rows, out / 8, 8) in column order
        return nibbles.reshape(t.shape[0], -1).T.contiguous()

    codes, zeros = unpack(qweight), unpack(qzeros)
    if zeros.shape != scales.T.shape or codes.shape[1] != zeros.shape[1] * group:
        raise ModelFormatError(f"AWQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                               f"scales {tuple(scales.shape)} with group size {group}")
    return GroupQuant(codes, scales.T.half().contiguous(), zeros, 4, group)


# --- GPTQ: qweight (in/pack, out), qzeros (groups, out/pack) holding zero - 1, scales (groups, out), g_idx (in,) --


def pack_gptq(q: GroupQuant) -> dict[str, torch.Tensor]:
    per_word = 32 // q.bits
    out, inp = q.codes.shape
    qweight = _pack_int32(q.codes.T.reshape(inp // per_word, per_word, out).transpose(1, 2), q.bits)
    zeros = q.zeros.T.to(torch.int16) - 1  # GPTQ's original format stores zero - 1, and every loader expects that
    qzeros = _pack_int32((zeros & (2**q.bits - 1)).reshape(zeros.shape[0], out // per_word, per_word), q.bits)
    g_idx = torch.arange(inp, dtype=torch.int32) // q.group
    return {"qweight": qweight, "qzeros": qzeros, "scales": q.scales.T.half().contiguous(), "g_idx": g_idx}


def unpack_gptq(qweight, qzeros, scales, g_idx, bits: int, zeros_minus_one: bool = True) -> GroupQuant | torch.Tensor:
    """A GroupQuant; or, for act-order checkpoints (g_idx not `i // group`), the dequantized W (out, in) fp32."""
    per_word = 32 // bits
    codes = _unpack_int32(qweight, bits).transpose(1, 2).reshape(-1, qweight.shape[1])  # (in, out)
    zeros = _unpack_int32(qzeros, bits).reshape(qzeros.shape[0], -1)  # (groups, out)
    if zeros_minus_one:
        zeros = ((zeros.to(torch.int16) + 1) & (2**bits - 1)).to(torch.uint8)
    inp, groups = codes.shape[0], scales.shape[0]
    if zeros.shape != scales.shape or qweight.shape[0] * per_word != inp or inp % groups:
        raise ModelFormatError(f"GPTQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                               f"scales {tuple(scales.shape)} for {bits}-bit codes")
    group = inp // groups
    if g_idx is not None and not torch.equal(g_idx.long().cpu(), torch.arange(inp) // group):
        g = g_idx.long()
        if g.shape != (inp,) or g.min() < 0 or g.max() >= groups:
            raise ModelFormatError(f"GPTQ g_idx {tuple(g_idx.shape)} does not name one of the {groups} groups for "
                                   f"each of the {inp} input columns")
        return (scales.float()[g] * (codes.float() - zeros.float()[g])).T.contiguous()
    return GroupQuant(codes.T.contiguous(), scales.T.half().contiguous(), zeros.T.contiguous(), bits, group)


# --- quantization_config of a checkpoint ----------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointQuant:
    """How an HF checkpoint's linear layers are quantized (its config.json `quantization_config`)."""

    method: str  # "awq" | "gptq"
    bits: int
    group: int  # -1: one group per row
    zeros_minus_one: bool = True  # GPTQ's original format
    act_order: bool = False  # GPTQ desc_act: input columns grouped by g_idx, not in order
    symmetric: bool = False  # every zero point is the middle code (GPTQ sym)

    @property
    def tensors(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales") + (("g_idx",) if self.method == "gptq" else ())

    def read(self, get) -> GroupQuant | torch.Tensor:
        """One linear layer from its tensors (`get(suffix)` -> tensor or None), each checked for the rank and
        dtype its format stores it with."""
        t = {suffix: get(suffix) for suffix in self.tensors}
        for suffix, tensor in t.items():
            if tensor is None:
                continue
            rank, kind = _STORED_AS[suffix]
            if tensor.dim() != rank or not kind[1](tensor):
                raise ModelFormatError(f"{suffix} is a {tensor.dim()}-D {str(tensor.dtype).removeprefix('torch.')} "
                                       f"tensor; {self.method.upper()} stores it as a {rank}-D tensor of {kind[0]}")
            if tensor.dtype == torch.uint32:  # the same 32 bits, as some writers label them
                t[suffix] = tensor.view(torch.int32)
        if self.method == "awq":
            return unpack_awq(t["qweight"], t["qzeros"], t["scales"], self.group)
        return unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], self.bits, self.zeros_minus_one)


_WORDS = ("32-bit words (int32)", lambda t: t.dtype in (torch.int32, torch.uint32))
_INDICES = ("integers", lambda t: t.dtype in (torch.int32, torch.int64))
_FLOATS = ("floats", torch.Tensor.is_floating_point)
# each tensor of a quantized layer: its rank and what its elements are
_STORED_AS = {"qweight": (2, _WORDS), "qzeros": (2, _WORDS), "scales": (2, _FLOATS), "g_idx": (1, _INDICES)}


def _whole(qc: dict, names: tuple[str, ...], default: int) -> int:
    """quantization_config's integer under the first of `names` it has (else `default`); anything else raises."""
    value = next((qc[name] for name in names if name in qc), default)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFormatError(f"config.json: quantization_config's {next((n for n in names if n in qc), names[0])} "
                               f"is {value!r}, not an integer")
    return value


def checkpoint_quant(config: dict) -> CheckpointQuant | None:
    """Parse config.json's `quantization_config`; None for a float checkpoint. Formats llmrun cannot read raise."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ModelFormatError(f"config.json: quantization_config is a {type(qc).__name__}, not an object")
    method = str(qc.get("quant_method", "?")).lower()
    bits = _whole(qc, ("bits", "w_bit"), 0)
    group = _whole(qc, ("group_size", "q_group_size"), -1)
    if group == 0 or group < -1:
        raise ModelFormatError(f"config.json: quantization_config's group_size is {group}: a positive number of "
                               "input columns a group, or -1 for one group a row")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or bits != 4 or not qc.get("zero_point", True):
            raise UnsupportedModelError(f"AWQ checkpoint with version {version!r}, {bits} bits: llmrun reads AWQ's "
                                        "'gemm' layout with 4-bit codes and zero points")
        return CheckpointQuant("awq", 4, group)
    if method == "gptq":
        if bits not in (4, 8):
            raise UnsupportedModelError(f"GPTQ checkpoint with {bits}-bit codes: llmrun reads 4 and 8 bits")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedModelError(f"GPTQ checkpoint format {fmt!r}: llmrun reads 'gptq' and 'gptq_v2'")
        return CheckpointQuant("gptq", bits, group, zeros_minus_one=fmt == "gptq", act_order=bool(qc.get("desc_act")),
                               symmetric=bool(qc.get("sym", True)))
    raise UnsupportedModelError(f"checkpoints quantized with {method!r}: llmrun reads 'awq' (gemm) and 'gptq'; "
                                "give an unquantized checkpoint or a GGUF file")
