"""GGUF quantized blocks -> group-quantized codes, without dequantizing to float.

A GGUF tensor of `rows x cols` values is stored row by row in blocks along `cols`. The 4-bit
types all decode to one form, 4-bit codes with a float scale and offset per group of 32 columns:

    w[r, c] = scale[r, c // 32] * code[r, c] + offset[r, c // 32]      code in [0, 15]

    Q4_0  (18 bytes / 32):  d (f16), 16 bytes of nibbles        scale d,      offset -8 d
    Q4_1  (20 bytes / 32):  d, m (f16), 16 bytes of nibbles     scale d,      offset m
    Q4_K  (144 bytes / 256): d, dmin (f16), 12 bytes of 6-bit sub-block scales and mins,
                            128 bytes of nibbles                scale d*sc_j, offset -dmin*m_j

Inside a 32-value block, value j < 16 is the low nibble of byte j and value j + 16 its high nibble.
A Q4_K super-block holds 8 sub-blocks of 32; its 128 nibble bytes are 4 chunks of 32 bytes whose
low nibbles are sub-block 2i and high nibbles sub-block 2i + 1.

Q8_0 (34 bytes / 32: d (f16), 32 int8) decodes to int8 codes with one scale per 32 values, and
so do Q5_0 (22 bytes / 32: d (f16), 4 bytes of high bits, 16 bytes of nibbles; value j's fifth
bit is bit j of the little-endian uint32 of high bits), as code - 16 in [-16, 15] with scale d,
and IQ4_NL (18 bytes / 32: d, 16 bytes of nibbles), as IQ4_VALUES[nibble] with scale d. Q5_1
(24 bytes / 32: d, m (f16), Q5_0's high bits and nibbles) decodes to codes in [0, 31], scale d,
offset m. Every decoder reproduces `gguf.dequantize` bit for bit through `dequantize_groups`
(tested).

For pagoda's CPU kernels, the super-block types also decode to their own numbers (`decode_k`),
which the kernels' forms hold as the file does (no product rounded):

    Q4_K: w = d * sc[g] * code - dmin * m[g]        per group g of 32, code in [0, 15]
    Q5_K  (176 bytes / 256: Q4_K's fields, then 32 bytes of fifth bits before the nibbles;
          group g's fifth bits are bit g of those bytes): as Q4_K, code in [0, 31]
    Q6_K  (210 bytes / 256: 128 bytes of low nibbles, 64 of top 2 bits, 16 int8 scales, d):
          w = d * sc[h] * (code - 32)              per 16 values h, code in [0, 63]
    IQ4_XS (136 bytes / 256: d, 2 bytes of high and 4 of low scale bits, 128 bytes of nibbles
          laid out as IQ4_NL's): w = d * sc[g] * IQ4_VALUES[code], sc 6-bit less 32, in [-32, 31]
    Q3_K  (110 bytes / 256: 32 bytes of third bits, 64 of 2-bit codes, 12 of 6-bit scales, d):
          w = d * sc[h] * (code - 4)               per 16 values h, code in [0, 7], sc in [-32, 31]
    Q2_K  (84 bytes / 256: 16 bytes of (sc | m << 4), 64 of 2-bit codes, d, dmin):
          w = d * sc[h] * code - dmin * m[h]       per 16 values h, code in [0, 3]
In both, value v's 2 bits are bits 2 (v % 128 // 32) of byte 32 (v // 128) + v % 32 of the codes;
Q3_K's third bit is bit v // 32 of byte v % 32 of its first 32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

GROUP = 32
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")
EIGHT_BIT_TYPES = ("Q8_0", "Q5_0", "IQ4_NL")  # int8 codes, one scale per 32 values, no offset
GROUP_TYPES = (*FOUR_BIT_TYPES, *EIGHT_BIT_TYPES, "Q5_1")  # decode's
_BLOCK_BYTES = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "IQ4_NL": (32, 18),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "IQ4_XS": (256, 136),
    "Q3_K": (256, 110),
    "Q2_K": (256, 84),
}
K_TYPES = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q3_K", "Q2_K")  # decode_k's
FLOAT16_TYPES = ("F16", "BF16")  # float16_weights
# IQ4_NL's and IQ4_XS's 16 values (ggml-common.h kvalues_iq4nl), a nibble picking one.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class GGUFWeight:
    """A GGUF tensor kept in its file encoding, on its way to a quantized layer.

    `data` holds the raw bytes, (rows, bytes per row) uint8; `shape` is (rows, cols) in torch order.
    """

    qtype: str
    data: np.ndarray
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """float32 (rows, cols), through the gguf package (the reference)."""
        from gguf import GGMLQuantizationType, dequantize

        array = dequantize(self.data, GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).reshape(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> GGUFWeight:
        """Rows [start, start + length) (dim 0), or columns (dim 1) on block boundaries: a
        tensor-parallel shard, cut from the raw bytes without decoding."""
        rows, cols = self.shape
        if dim == 0:
            data = np.ascontiguousarray(self.data[start : start + length])
            return GGUFWeight(self.qtype, data, (length, cols))
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[self.qtype]]
        if start % per_block or length % per_block:
            raise ValueError(
                f"a GGUF {self.qtype} tensor splits only on its {per_block}-column blocks; "
                f"columns [{start}, {start + length}) are not: choose another "
                "tensor_parallel_size"
            )
        first, num = start // per_block * nbytes, length // per_block * nbytes
        data = np.ascontiguousarray(self.data[:, first : first + num])
        return GGUFWeight(self.qtype, data, (rows, length))

    def permute_rows(self, order: torch.Tensor) -> GGUFWeight:
        """Rows reordered (blocks never straddle rows, so this is exact on the raw bytes)."""
        data = np.ascontiguousarray(self.data[order.numpy()])
        return GGUFWeight(self.qtype, data, self.shape)


@dataclass(frozen=True)
class GroupCodes:
    """w = scale[:, g] * codes + offset[:, g] for columns of group g (offset None: no offset).

    codes: (rows, cols) uint8 (4-bit) or int8 (Q8_0, Q5_0); scale, offset: (rows, cols // 32) float32.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None


def _blocks(w: GGUFWeight) -> np.ndarray:
    per_block, nbytes = _BLOCK_BYTES[w.qtype]
    rows, cols = w.shape
    if cols % per_block:
        raise ValueError(f"GGUF {w.qtype} tensor with {cols} columns is not whole blocks")
    return np.ascontiguousarray(w.data).reshape(rows * cols // per_block, nbytes)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) codes: low nibbles then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _five_bits(high: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 codes in [0, 31]: (n, 4) bytes of fifth bits, (n, 16) of nibbles -> (n, 32)."""
    bits = np.ascontiguousarray(high).view("<u4")  # (n, 1)
    fifth = ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _nibbles(qs) | (fifth << 4)


def decode(w: GGUFWeight) -> GroupCodes:
    """The group codes of a GROUP_TYPES tensor."""
    rows, cols = w.shape
    blocks = _blocks(w)
    if w.qtype == "Q8_0":
        scale = _f16(blocks[:, :2])
        codes = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)
        return _group_codes(codes, scale, None, rows, cols)
    if w.qtype == "Q5_0":
        codes = _five_bits(blocks[:, 2:6], blocks[:, 6:]).astype(np.int8) - np.int8(16)
        return _group_codes(codes, _f16(blocks[:, :2]), None, rows, cols)
    if w.qtype == "Q5_1":
        d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        return _group_codes(_five_bits(blocks[:, 4:8], blocks[:, 8:]), d, m, rows, cols)
    if w.qtype == "IQ4_NL":
        values = np.array(IQ4_VALUES, dtype=np.int8)[_nibbles(blocks[:, 2:])]
        return _group_codes(values, _f16(blocks[:, :2]), None, rows, cols)
    if w.qtype == "Q4_0":
        d = _f16(blocks[:, :2])
        return _group_codes(_nibbles(blocks[:, 2:]), d, -8 * d, rows, cols)
    if w.qtype == "Q4_1":
        d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        return _group_codes(_nibbles(blocks[:, 4:]), d, m, rows, cols)
    if w.qtype == "Q4_K":
        return _decode_q4_k(blocks, rows, cols)
    raise ValueError(f"GGUF type {w.qtype} has no group decoding; dequantize it instead")


def _q4_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """(d, dmin (n, 1) float32; sc, m (n, 8) uint8 in [0, 63]; codes (n, 256) uint8)."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    lo, hi, mix = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    qs = blocks[:, 16:].reshape(n, 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 256)
    return d, dmin, sc, mn, codes


def _decode_q4_k(blocks: np.ndarray, rows: int, cols: int) -> GroupCodes:
    d, dmin, sc, mn, codes = _q4_k_fields(blocks)
    scale = d * sc.astype(np.float32)  # (n, 8)
    offset = -(dmin * mn.astype(np.float32))
    return _group_codes(codes, scale.reshape(-1, 1), offset.reshape(-1, 1), rows, cols)


@dataclass(frozen=True)
class KQuantCodes:
    """A K_TYPES tensor's own numbers (module docstring): codes (rows, cols) uint8 (IQ4_XS: the
    nibbles, indices into IQ4_VALUES); sc (rows, cols // 32) uint8 (Q4_K, Q5_K) or int8 (IQ4_XS),
    or (rows, cols // 16) int8 (Q6_K, Q3_K) or uint8 (Q2_K); m (rows, cols // 32) uint8 (Q4_K,
    Q5_K), (rows, cols // 16) (Q2_K) or None; d, dmin (rows, cols // 256) float16 (dmin None but
    for Q4_K, Q5_K and Q2_K)."""

    qtype: str
    codes: torch.Tensor
    sc: torch.Tensor
    m: torch.Tensor | None
    d: torch.Tensor
    dmin: torch.Tensor | None


def decode_k(w: GGUFWeight) -> KQuantCodes:
    """The own numbers of a K_TYPES tensor."""
    rows, cols = w.shape
    blocks = _blocks(w)

    def t(a: np.ndarray, width: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).reshape(rows, width)

    def half(raw: np.ndarray) -> torch.Tensor:
        return t(np.ascontiguousarray(raw).view(np.float16), cols // 256)

    if w.qtype in ("Q4_K", "Q5_K"):
        if w.qtype == "Q5_K":  # Q4_K's fields with the 32 bytes of fifth bits taken out
            high = blocks[:, 16:48]
            blocks = np.concatenate([blocks[:, :16], blocks[:, 48:]], axis=1)
        _, _, sc, mn, codes = _q4_k_fields(blocks)
        if w.qtype == "Q5_K":  # group g's value l: bit g of byte l
            fifth = (high[:, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
            codes = codes | (fifth.reshape(-1, 256) << 4)
        return KQuantCodes(
            w.qtype,
            t(codes, cols),
            t(sc, cols // 32),
            t(mn, cols // 32),
            half(blocks[:, 0:2]),
            half(blocks[:, 2:4]),
        )
    if w.qtype == "IQ4_XS":
        n = blocks.shape[0]
        high = np.ascontiguousarray(blocks[:, 2:4]).view("<u2")  # (n, 1)
        high = (high >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # (n, 8)
        low = (blocks[:, 4:8, None] >> np.array([0, 4], np.uint8)) & 0x0F  # (n, 4, 2)
        sc = (low.reshape(n, 8) | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
        codes = _nibbles(blocks[:, 8:].reshape(n * 8, 16)).reshape(n, 256)
        return KQuantCodes(
            "IQ4_XS", t(codes, cols), t(sc, cols // 32), None, half(blocks[:, :2]), None
        )
    if w.qtype == "Q6_K":
        n = blocks.shape[0]
        ql = (
            blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
        ) & 0x0F
        qh = (
            blocks[:, 128:192].reshape(n, 2, 1, 32)
            >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        ) & 3
        codes = ql.reshape(n, 256) | (qh.reshape(n, 256) << 4)
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)
        return KQuantCodes(
            "Q6_K", t(codes, cols), t(sc, cols // 16), None, half(blocks[:, 208:210]), None
        )
    if w.qtype in ("Q3_K", "Q2_K"):
        return _decode_two_bit(w.qtype, blocks, cols, t, half)
    raise ValueError(f"GGUF type {w.qtype} is not a k-quant decode_k reads")


def _decode_two_bit(qtype: str, blocks: np.ndarray, cols: int, t: Any, half: Any) -> KQuantCodes:
    """decode_k of Q3_K / Q2_K (t, half: decode_k's (array, width) -> tensor helpers)."""
    n = blocks.shape[0]
    at = 32 if qtype == "Q3_K" else 16  # the 2-bit codes
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    codes = ((blocks[:, at : at + 64].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 256)
    if qtype == "Q2_K":
        sc, mn = blocks[:, :16] & 0x0F, blocks[:, :16] >> 4
        d, dmin = half(blocks[:, 80:82]), half(blocks[:, 82:84])
        return KQuantCodes("Q2_K", t(codes, cols), t(sc, cols // 16), t(mn, cols // 16), d, dmin)
    third = (blocks[:, None, :32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    codes = codes | (third.reshape(n, 256) << 2)
    low = (blocks[:, 96:104, None] >> np.array([0, 4], np.uint8)) & 0x0F  # (n, 8, 2)
    high = (blocks[:, 104:108, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3  # (n, 4, 4)
    low, high = low.transpose(0, 2, 1).reshape(n, 16), high.transpose(0, 2, 1).reshape(n, 16)
    sc = (low | (high << 4)).astype(np.int8) - np.int8(32)
    return KQuantCodes(
        "Q3_K", t(codes, cols), t(sc, cols // 16), None, half(blocks[:, 108:110]), None
    )


def dequantize_k(k: KQuantCodes) -> torch.Tensor:
    """float32 (rows, cols) of decode_k's numbers, as gguf computes them (d * sc first)."""
    if k.qtype in ("Q3_K", "Q2_K"):
        scale = (k.d.float().repeat_interleave(16, 1) * k.sc.float()).repeat_interleave(16, 1)
        if k.qtype == "Q3_K":
            return scale * (k.codes.float() - 4)
        assert k.m is not None and k.dmin is not None
        offset = k.dmin.float().repeat_interleave(16, 1) * k.m.float()
        return scale * k.codes.float() - offset.repeat_interleave(16, 1)
    if k.qtype == "IQ4_XS":
        scale = k.d.float().repeat_interleave(8, 1) * k.sc.float()
        values = torch.tensor(IQ4_VALUES, dtype=torch.float32)[k.codes.long()]
        return scale.repeat_interleave(GROUP, 1) * values
    if k.qtype in ("Q4_K", "Q5_K"):
        assert k.m is not None and k.dmin is not None
        scale = k.d.float().repeat_interleave(8, 1) * k.sc.float()
        offset = k.dmin.float().repeat_interleave(8, 1) * k.m.float()
        w = scale.repeat_interleave(GROUP, 1) * k.codes.float()
        return w - offset.repeat_interleave(GROUP, 1)
    scale = k.d.float().repeat_interleave(16, 1) * k.sc.float()
    return scale.repeat_interleave(16, 1) * (k.codes.float() - 32)


def float16_weights(w: GGUFWeight) -> torch.Tensor:
    """An F16 or BF16 tensor's weights as they are: (rows, cols) float16 or bfloat16."""
    raw = np.array(w.data, copy=True)  # the file's memory map is read-only
    if w.qtype == "F16":
        return torch.from_numpy(raw.view(np.float16)).reshape(w.shape)
    return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).reshape(w.shape)


def _group_codes(
    codes: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, rows: int, cols: int
) -> GroupCodes:
    groups = cols // GROUP
    return GroupCodes(
        codes=torch.from_numpy(np.ascontiguousarray(codes)).reshape(rows, cols),
        scale=torch.from_numpy(np.ascontiguousarray(scale)).reshape(rows, groups),
        offset=None
        if offset is None
        else torch.from_numpy(np.ascontiguousarray(offset)).reshape(rows, groups),
    )


def dequantize_groups(g: GroupCodes) -> torch.Tensor:
    """float32 (rows, cols) with gguf's own order of operations (scale * code, then + offset)."""
    scale = g.scale.repeat_interleave(GROUP, dim=1)
    w = scale * g.codes.to(torch.float32)
    if g.offset is not None:
        w = w + g.offset.repeat_interleave(GROUP, dim=1)
    return w
