"""The forms of pagoda's CPU kernels (pagoda/kernels/cpu/quant_gemm.cpp): how a quantized
layer's codes are packed for them, the buffers they leave on the layer, and the matmuls over
them. layers/quant_forms.py holds torch's and Triton's forms; where the kernels serve a layer
(quant_forms.cpu_kernels_for) the callers leave these forms instead (layers/quant.py chooses
per scheme).

GGUF layers and the int8 rows keep these forms: codes in tiles of 16 rows laid out for VNNI dot
products, multiplied against int8-quantized activations, for every step size. The nibble forms
(NIBBLE_FORMS, the number naming each to the q4x16 ops) hold a GGUF type's own numbers and, but
for the 6-bit sub-scales a byte each, its bytes:

    cpu_q4:    (ceil(N / 16), K // 32, 320) uint8, w = scale * code + offset (fp16; GGUF Q4_1,
               pagoda's int4)
    cpu_q4_0:  (.., K // 32, 288), GGUF Q4_0: w = scale * (code - 8)
    cpu_q5:    (.., K // 32, 352), GGUF Q5_0: w = scale * (code - 16) (low nibbles, a bit plane
               of fifth bits, fp16 scales)
    cpu_q5_1:  (.., K // 32, 384), GGUF Q5_1: w = scale * code + offset, code in [0, 31]
    cpu_iq4nl: (.., K // 32, 288), GGUF IQ4_NL: w = scale * IQ4_VALUES[code]
    cpu_q4k:   (.., K // 256, 2368), GGUF Q4_K (x1.03: its sub-scales and mins a byte each)
    cpu_q5k:   (.., K // 256, 2880), GGUF Q5_K (x1.02, the same)
    cpu_q6k:   (.., K // 256, 3360), GGUF Q6_K
    cpu_iq4xs: (.., K // 256, 2208), GGUF IQ4_XS (x1.01: its sub-scales a byte each)
    cpu_q3k:   (.., K // 256, 1824), GGUF Q3_K (x1.04: its sub-scales a byte each)
    cpu_q2k:   (.., K // 256, 1344), GGUF Q2_K

and the others:

    cpu_q8:    packed (ceil(N / 16), K // 32, 512) uint8 (code + 128), packed_scales float32
               (ceil(N / 16), K // 32 or 1, 16): w = scale * code, per group or per row
    cpu_f16, cpu_bf16: packed (ceil(N / 16), K, 16) int16, GGUF F16 / BF16 weights as the file
               holds them (2 bytes a weight), against float32 activations (float_gemm.cpp)
    cpu_parts: a merged layer whose shards differ in type, each shard a KernelPart in its form
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _nibble_blocks(codes: torch.Tensor, tiles: int) -> torch.Tensor:
    """The low 4 bits of codes (N, K) as the nibble forms' blocks: uint8 (tiles, K // 32, 256),
    per group 4 blocks of 64 bytes (block s, byte 4j + b: row j's code 8s + b in the low
    nibble, 8s + 4 + b in the high one), N padded with zero rows."""
    n, k = codes.shape
    c = F.pad(codes.to(torch.uint8) & 0x0F, (0, 0, 0, 16 * tiles - n))
    c = c.view(tiles, 16, k // 32, 4, 2, 4)
    nibbles = c[..., 0, :] | (c[..., 1, :] << 4)  # (T, j, G, s, b)
    return nibbles.permute(0, 2, 3, 1, 4).reshape(tiles, k // 32, 256)


def _tile_rows(t: torch.Tensor, tiles: int) -> torch.Tensor:
    """Per-row numbers (N, U, ...) -> (tiles, U, 16, ...), N padded with zeros."""
    t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, 16 * tiles - t.shape[0]))
    return t.view(tiles, 16, *t.shape[1:]).transpose(1, 2)


def _crumb_blocks(codes: torch.Tensor, tiles: int) -> torch.Tensor:
    """The low 2 bits of codes (N, K) as the 2-bit forms' blocks: uint8 (tiles, K // 32, 128),
    per group 2 blocks of 64 bytes (block t, byte 4j + b, bits 2c .. 2c + 1: row j's code
    8s + 4h + b for 2s + h = 4t + c, the code the 4-bit blocks keep in block s's low (h = 0)
    or high nibble), N padded with zero rows."""
    n, k = codes.shape
    c = F.pad(codes.to(torch.uint8) & 3, (0, 0, 0, 16 * tiles - n))
    c = c.view(tiles, 16, k // 32, 2, 4, 4)  # (T, j, G, t, c, b)
    crumbs = c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)
    return crumbs.permute(0, 2, 3, 1, 4).reshape(tiles, k // 32, 128)


def _fifth_masks(codes: torch.Tensor, tiles: int, bit: int = 4) -> torch.Tensor:
    """Bit `bit` of codes (N, K) as the masks: uint8 (tiles, K // 32, 64), 8 masks of 64 bits a
    group (mask 2s + h, bit 4j + b: that bit of row j's code 8s + 4h + b)."""
    n, k = codes.shape
    groups = k // 32
    c = F.pad(codes.to(torch.uint8), (0, 0, 0, 16 * tiles - n)).view(tiles, 16, groups, 4, 2, 4)
    fifth = ((c >> bit) & 1).permute(0, 2, 3, 4, 1, 5).reshape(tiles, groups, 8, 8, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32)
    return (fifth.to(torch.int32) * weights).sum(-1).to(torch.uint8).view(tiles, groups, 64)


def pack_groups16(codes: torch.Tensor, numbers: list[torch.Tensor], fifth: bool) -> torch.Tensor:
    """A group nibble form: codes (N, K) in [0, 15] (fifth: [0, 31]), per-group numbers (N,
    K // 32) each -> uint8 (ceil(N / 16), K // 32, 256 (+ 64) + 32 per number), per tile of 16
    rows and group: 4 blocks of 64 bytes (block s, byte 4j + b: row j's code 8s + b in the low
    nibble, 8s + 4 + b in the high one), then (fifth) the masks of fifth bits, then each
    number's 16 rows as fp16 (N padded with zero rows). ValueError where a number does not fit
    fp16."""
    n, k = codes.shape
    groups, tiles = k // 32, -(-n // 16)
    half = torch.stack(numbers).to(torch.float16)
    if not torch.isfinite(half).all():
        raise ValueError("scales or offsets beyond fp16's range")
    rows = F.pad(half, (0, 0, 0, 16 * tiles - n)).view(len(numbers), tiles, 16, groups)
    fp16 = rows.permute(1, 3, 0, 2).contiguous().view(torch.uint8)  # (T, G, numbers, 16 x 2)
    code_part = [_nibble_blocks(codes, tiles)] + ([_fifth_masks(codes, tiles)] if fifth else [])
    return torch.cat([*code_part, fp16.reshape(tiles, groups, -1)], -1).contiguous()


def pack_q4x16(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The CPU kernels' 4-bit form (cpu_q4), w = scale * code + offset per group of 32: codes
    (N, K) in [0, 15], scale and offset (N, K // 32) -> uint8 (ceil(N / 16), K // 32, 320)
    (pack_groups16's). ValueError where a scale or offset does not fit fp16."""
    return pack_groups16(codes, [scale.float(), offset.float()], fifth=False)


def pack_q8x16(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernels' 8-bit form, w = scale * code: codes (N, K) int8, scale (N, K // 32) or
    (N, 1) -> (uint8 (ceil(N / 16), K // 32, 512): per tile of 16 rows and group, 8 blocks of
    64 bytes, block s byte 4j + b holding row j's code 4s + b plus 128; float32 scales
    (ceil(N / 16), K // 32 or 1, 16)), N padded with zero rows."""
    n, k = codes.shape
    groups, pad = k // 32, -n % 16
    tiles = (n + pad) // 16
    c = F.pad(codes.to(torch.int16) + 128, (0, 0, 0, pad), value=128).to(torch.uint8)
    packed = c.view(tiles, 16, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 512)
    s = F.pad(scale.float(), (0, 0, 0, pad)).view(tiles, 16, -1).permute(0, 2, 1)
    return packed.contiguous(), s.contiguous()


def set_cpu_q4(layer: Any, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> bool:
    """Leave the CPU kernels' 4-bit form on the layer (w = scale * code + offset, groups of 32);
    False where a scale or offset does not fit fp16 (the caller keeps torch's form).
    fp16 holds Q4_0 / Q4_1's scales exactly (the file's) and rounds Q4_K's products of a scale
    and a 6-bit sub-scale to 11 bits (torch's form keeps 8: bf16)."""
    try:
        packed = pack_q4x16(codes, scale.float(), offset.float())
    except ValueError:
        return False
    set_cpu_packed(layer, "cpu_q4", packed, codes.shape[0])
    return True


def set_cpu_packed(layer: Any, kernel: str, packed: torch.Tensor, rows: int) -> None:
    """Leave a form held in one buffer (a NIBBLE_FORMS or FLOAT16_KERNELS `kernel`, its `packed`
    tiles of `rows` rows) on the layer."""
    layer.register_buffer("packed", packed)
    layer.cpu_rows = rows
    layer.kernel = kernel


def pack_q5x16(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The CPU kernels' 5-bit form, w = scale * (code - 16) per group of 32: codes (N, K) in
    [0, 31], scale (N, K // 32) (fp16 values: Q5_0's d) -> uint8 (ceil(N / 16), K // 32, 352),
    per tile of 16 rows and group: the low nibbles as pack_q4x16's 4 blocks of 64 bytes, then 8
    masks of 64 bits (mask 2s + h, bit 4j + b: the fifth bit of row j's code 8s + 4h + b), then
    the 16 scales as fp16 (N padded with zero rows)."""
    return pack_groups16(codes, [scale.float()], fifth=True)


def pack_q4kx16(
    codes: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
) -> torch.Tensor:
    """The CPU kernels' Q4_K form, w = d * sc[g] * code - dmin * m[g]: codes (N, K) in [0, 15];
    sc, m (N, K // 32) in [0, 63]; d, dmin (N, K // 256) fp16 -> uint8 (ceil(N / 16), K // 256,
    2368), per tile of 16 rows and super-block of 8 groups: the groups' nibble blocks
    (pack_q4x16's), then per group the 16 rows' sc, then their m, a byte each, then the 16 d
    and the 16 -dmin as fp16. 148 bytes a row and 256 values: the file's 144, its 6-bit numbers
    unpacked to a byte each (quant_gemm.cpp says why). Q5_K's form (codes in [0, 31]) is this
    one with each group's nibble blocks followed by its masks of fifth bits: 180 bytes a row
    and 256 values for the file's 176."""
    return _pack_min_k(codes, sc, m, d, dmin, fifth=False)


def _pack_min_k(
    codes: torch.Tensor,
    sc: torch.Tensor,
    m: torch.Tensor,
    d: torch.Tensor,
    dmin: torch.Tensor,
    fifth: bool,
) -> torch.Tensor:
    n, k = codes.shape
    tiles, supers = -(-n // 16), k // 256
    code_part = _nibble_blocks(codes, tiles).view(tiles, supers, 8, 256)
    if fifth:
        masks = _fifth_masks(codes, tiles).view(tiles, supers, 8, 64)
        code_part = torch.cat([code_part, masks], -1)
    code_part = code_part.reshape(tiles, supers, -1)
    sc8, m8 = (_tile_rows(t.to(torch.uint8).view(n, supers, 8), tiles) for t in (sc, m))
    meta = torch.stack([sc8, m8], -2).permute(0, 1, 4, 3, 2)  # (T, S, 8 groups, sc | m, 16 rows)
    halves = [
        _tile_rows(t.to(torch.float16), tiles)
        .contiguous()
        .view(torch.uint8)
        .view(tiles, supers, 32)
        for t in (d, -dmin)
    ]
    return torch.cat([code_part, meta.reshape(tiles, supers, 256), *halves], -1).contiguous()


def pack_q6kx16(codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The CPU kernels' Q6_K form, w = d * sc[h] * (code - 32): codes (N, K) in [0, 63], sc
    (N, K // 16) int8, d (N, K // 256) fp16 -> uint8 (ceil(N / 16), K // 256, 3360), per tile
    of 16 rows and super-block of 8 groups: per group its nibble blocks (pack_q4x16's) and 128
    bytes of top 2 bits (block s's byte p of the nibble blocks has its 4 bits, the low nibble's
    code's then the high one's, in byte 32s + p % 32, low nibble for p < 32), then per group
    the rows' two scales (values [0, 16), then [16, 32)), then the 16 d as fp16. 210 bytes a
    row and 256 values, the file's."""
    n, k = codes.shape
    tiles, supers = -(-n // 16), k // 256
    nibbles = _nibble_blocks(codes, tiles).view(tiles, supers, 8, 256)
    c = F.pad(codes.to(torch.uint8) >> 4, (0, 0, 0, 16 * tiles - n))
    top = c.view(tiles, 16, supers, 8, 4, 2, 4)  # (T, j, S, g, s, low/high nibble, b)
    bits = (top[..., 0, :] | (top[..., 1, :] << 2)).permute(0, 2, 3, 4, 1, 5)  # (T, S, g, s, j, b)
    bits = bits.reshape(tiles, supers, 8, 4, 64)
    high = (bits[..., :32] | (bits[..., 32:] << 4)).reshape(tiles, supers, 8, 128)
    groups = torch.cat([nibbles, high], -1).reshape(tiles, supers, 3072)
    scales = _tile_rows(sc.to(torch.int8).view(n, supers, 8, 2), tiles)  # (T, S, 16, 8, 2)
    scales = scales.permute(0, 1, 3, 4, 2).contiguous().view(torch.uint8).view(tiles, supers, 256)
    half = _tile_rows(d.to(torch.float16), tiles).contiguous().view(torch.uint8)
    return torch.cat([groups, scales, half.view(tiles, supers, 32)], -1).contiguous()


def pack_iq4xsx16(codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The CPU kernels' IQ4_XS form, w = d * sc[g] * IQ4_VALUES[code]: codes (N, K) in [0, 15],
    sc (N, K // 32) int8 in [-32, 31], d (N, K // 256) fp16 -> uint8 (ceil(N / 16), K // 256,
    2208), per tile of 16 rows and super-block: the 8 groups' nibble blocks, then per group the
    16 rows' sc, then the 16 d as fp16. 138 bytes a row and 256 values: the file's 136, its
    6-bit sub-scales a byte each."""
    n, k = codes.shape
    tiles, supers = -(-n // 16), k // 256
    code_part = _nibble_blocks(codes, tiles).reshape(tiles, supers, 2048)
    scales = _tile_rows(sc.to(torch.int8).view(n, supers, 8), tiles)  # (T, S, 16, 8)
    scales = scales.permute(0, 1, 3, 2).contiguous().view(torch.uint8).view(tiles, supers, 128)
    half = _tile_rows(d.to(torch.float16), tiles).contiguous().view(torch.uint8)
    return torch.cat([code_part, scales, half.view(tiles, supers, 32)], -1).contiguous()


def pack_two_bit_x16(
    codes: torch.Tensor,
    sc: torch.Tensor,
    m: torch.Tensor | None,
    d: torch.Tensor,
    dmin: torch.Tensor | None,
) -> torch.Tensor:
    """The CPU kernels' Q3_K form (m, dmin None; w = d * sc[h] * (code - 4), codes (N, K) in
    [0, 7], sc (N, K // 16) int8) or Q2_K form (w = d * sc[h] * code - dmin * m[h], codes in
    [0, 3], sc and m (N, K // 16) in [0, 15]); d, dmin (N, K // 256) fp16 -> uint8
    (ceil(N / 16), K // 256, 1824 or 1344), per tile of 16 rows and super-block: per group its
    2 crumb blocks (_crumb_blocks) and, for Q3_K, the masks of third bits; then per group the
    16 rows' two int8 sc (Q3_K) or two (sc | m << 4) bytes (Q2_K), values [0, 16) then
    [16, 32); then the 16 d, and for Q2_K the 16 -dmin, as fp16. 114 (the file's 110 with its
    6-bit scales a byte each) and 84 (the file's) bytes a row and 256 values."""
    n, k = codes.shape
    tiles, supers = -(-n // 16), k // 256
    code_part = _crumb_blocks(codes, tiles).view(tiles, supers, 8, 128)
    if m is None:  # Q3_K
        masks = _fifth_masks(codes, tiles, bit=2).view(tiles, supers, 8, 64)
        code_part = torch.cat([code_part, masks], -1)
        numbers = sc.to(torch.int8).view(torch.uint8)
    else:
        numbers = sc.to(torch.uint8) | (m.to(torch.uint8) << 4)
    meta = _tile_rows(numbers.view(n, supers, 8, 2), tiles)  # (T, S, 16, 8, 2)
    meta = meta.permute(0, 1, 3, 4, 2).reshape(tiles, supers, 256)
    halves = [
        _tile_rows(t.to(torch.float16), tiles)
        .contiguous()
        .view(torch.uint8)
        .view(tiles, supers, 32)
        for t in ([d] if dmin is None else [d, -dmin])
    ]
    return torch.cat([code_part.reshape(tiles, supers, -1), meta, *halves], -1).contiguous()


# The k-quant forms: GGUF type -> kernel.
K_KERNELS = {
    "Q4_K": "cpu_q4k",
    "Q5_K": "cpu_q5k",
    "Q6_K": "cpu_q6k",
    "IQ4_XS": "cpu_iq4xs",
    "Q3_K": "cpu_q3k",
    "Q2_K": "cpu_q2k",
}


def pack_kx16(k: Any) -> torch.Tensor:
    """k (layers/gguf.KQuantCodes, the file's own numbers) in its K_KERNELS form."""
    if k.qtype in ("Q4_K", "Q5_K"):
        return _pack_min_k(k.codes, k.sc, k.m, k.d, k.dmin, fifth=k.qtype == "Q5_K")
    if k.qtype == "Q6_K":
        return pack_q6kx16(k.codes, k.sc, k.d)
    if k.qtype in ("Q3_K", "Q2_K"):
        return pack_two_bit_x16(k.codes, k.sc, k.m, k.d, k.dmin)
    return pack_iq4xsx16(k.codes, k.sc, k.d)


def set_cpu_k(layer: Any, k: Any) -> None:
    """Leave the CPU kernels' form of a super-block type on the layer (k:
    layers/gguf.KQuantCodes)."""
    set_cpu_packed(layer, K_KERNELS[k.qtype], pack_kx16(k), k.codes.shape[0])


def set_cpu_q5(layer: Any, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Leave the CPU kernels' 5-bit form on the layer (w = scale * (code - 16), codes in
    [0, 31], groups of 32: GGUF Q5_0's bytes)."""
    set_cpu_packed(layer, "cpu_q5", pack_q5x16(codes, scale), codes.shape[0])


class KernelPart(nn.Module):
    """One shard's CPU-kernel form inside a merged layer whose shards differ in type (the
    `layer` argument of the set_cpu_* functions): its buffers, `cpu_rows` and `kernel`."""

    kernel: str
    cpu_rows: int

    def __init__(self, layer: Any) -> None:
        super().__init__()
        self.device, self.dtype = layer.device, layer.dtype


def set_cpu_parts(layer: Any, parts: list[KernelPart]) -> None:
    """A merged layer as its shards' own forms, outputs concatenated in shard order."""
    layer.parts = nn.ModuleList(parts)
    layer.cpu_rows = sum(p.cpu_rows for p in parts)
    layer.kernel = "cpu_parts"


def pack_f16x16(w: torch.Tensor) -> torch.Tensor:
    """The CPU kernels' float16 form: w (N, K) float16 or bfloat16 -> int16 (ceil(N / 16), K,
    16), element [t, k, j] the bits of w[16t + j, k], N padded with zero rows."""
    n, k = w.shape
    tiles = -(-n // 16)
    rows = F.pad(w, (0, 0, 0, 16 * tiles - n)).view(tiles, 16, k)
    return rows.transpose(1, 2).contiguous().view(torch.int16)


def set_cpu_float16(layer: Any, w: torch.Tensor) -> None:
    """Leave the CPU kernels' float16 form of w (N, K) float16 or bfloat16 on the layer."""
    kernel = "cpu_bf16" if w.dtype == torch.bfloat16 else "cpu_f16"
    set_cpu_packed(layer, kernel, pack_f16x16(w), w.shape[0])


def set_cpu_q8(layer: Any, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Leave the CPU kernels' 8-bit form on the layer (w = scale * code; scale (N, K // 32) or
    (N, 1))."""
    packed, scales = pack_q8x16(codes.to(torch.int8), scale)
    layer.register_buffer("packed", packed)
    layer.register_buffer("packed_scales", scales)
    layer.cpu_rows = codes.shape[0]
    layer.kernel = "cpu_q8"


def cpu_q8_rows(layer: Any, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a "cpu_q8" layer's weight, float32 (the embedding's lookup)."""
    tiles, groups, _ = layer.packed.shape
    tile, lane = ids // 16, ids % 16
    codes = layer.packed.view(tiles, groups, 8, 16, 4)[tile, :, :, lane, :]  # (n, G, 8, 4)
    codes = codes.reshape(ids.shape[0], groups, 32).to(torch.int16) - 128
    scales = layer.packed_scales[tile, :, lane]  # (n, G or 1)
    return (codes * scales[..., None]).reshape(ids.shape[0], groups * 32)


# The kernel forms of pagoda's CPU kernels: the nibble ones run the q4x16 ops, which take the
# form's number (quant_gemm.cpp's Form), cpu_q8 the q8x16 ones.
NIBBLE_FORMS = {
    "cpu_q4": 0,
    "cpu_q5": 1,
    "cpu_q4k": 2,
    "cpu_q6k": 3,
    "cpu_q4_0": 4,
    "cpu_q5_1": 5,
    "cpu_q5k": 6,
    "cpu_iq4nl": 7,
    "cpu_iq4xs": 8,
    "cpu_q3k": 9,
    "cpu_q2k": 10,
}
FLOAT16_KERNELS = ("cpu_f16", "cpu_bf16")
CPU_KERNELS = (*NIBBLE_FORMS, *FLOAT16_KERNELS, "cpu_q8", "cpu_parts")


# The quantized matmuls' isa_limit: 3 lets their passes of 16 or more rows take the tile unit
# (AMX) where the CPU has it, with the bits of the AVX-512 VNNI path (kernels/cpu/quant_gemm.cpp).
MATMUL_ISA = 3


def _lora_args(lora: Any, rows: torch.Tensor) -> tuple[Any, ...]:
    """The quantized matmul ops' optional lora_a, lora_b, lora_slots, lora_offsets for a
    LoRAWeights (layers/lora.py) and x's rows; () without adapters."""
    if lora is None:
        return ()
    return (lora.a, lora.b, lora.slots[: rows.shape[0]], lora.offsets)


def cpu_matmul(layer: Any, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
    """x @ w^T on pagoda's CPU kernels: x (..., K) -> float32 (..., N). lora: the layer's
    LoRAWeights (their C++ route, LoRAWeights.cpu_kernel), whose products are added to y: by
    the quantized matmul's own call (kernels/cpu/lora.h), or after the float16 forms' and
    merged layers' matmuls."""
    ops = torch.ops.pagoda_cpu
    rows = x.reshape(-1, x.shape[-1])
    if layer.kernel == "cpu_parts":
        y = torch.cat([cpu_matmul(p, rows) for p in layer.parts], -1)
    elif layer.kernel in NIBBLE_FORMS:
        form = NIBBLE_FORMS[layer.kernel]
        y = ops.q4x16_matmul(
            rows, layer.packed, layer.cpu_rows, MATMUL_ISA, form, *_lora_args(lora, rows)
        )
        lora = None
    elif layer.kernel in FLOAT16_KERNELS:
        bf16 = layer.kernel == "cpu_bf16"
        y = ops.f16x16_matmul(rows, layer.packed, layer.cpu_rows, 2, bf16)
    else:
        lora_args = _lora_args(lora, rows)
        y = ops.q8x16_matmul(
            rows, layer.packed, layer.packed_scales, layer.cpu_rows, MATMUL_ISA, *lora_args
        )
        lora = None
    if lora is not None:
        y = lora.add_to(y, rows)
    return y.view(*x.shape[:-1], layer.cpu_rows)


def cpu_matmul_norm(
    layer: Any, x: torch.Tensor, residual: torch.Tensor | None, norm: Any, lora: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cpu_matmul of norm(x + residual) and x + residual (x where residual is None), in one
    call: x, residual (T, K); norm a RMSNorm -> (float32 (T, N), (T, K)). cpu_parts and the
    float16 forms: the norm's op, then the matmul. lora: as cpu_matmul's."""
    ops = torch.ops.pagoda_cpu
    if layer.kernel == "cpu_parts" or layer.kernel in FLOAT16_KERNELS:
        normed, hidden = ops.add_rms_norm(x, residual, norm.weight, norm.eps, 2)
        return cpu_matmul(layer, normed, lora), hidden
    lora_args = _lora_args(lora, x)
    if layer.kernel in NIBBLE_FORMS:
        args = _nibble_norm_args(layer, x, residual, norm)
        return ops.q4x16_matmul_norm(*args, *lora_args)  # type: ignore[no-any-return]
    return ops.q8x16_matmul_norm(  # type: ignore[no-any-return]
        x,
        residual,
        norm.weight,
        norm.eps,
        layer.packed,
        layer.packed_scales,
        layer.cpu_rows,
        MATMUL_ISA,
        *lora_args,
    )


def cpu_matmul_norm_silu(
    layer: Any, x: torch.Tensor, residual: torch.Tensor | None, norm: Any
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(silu_and_mul(cpu_matmul_norm(...)[0]), x + residual) in one call, the same bits, for a
    gate | up layer (its rows the gate's, then the up's) in a nibble form whose halves are whole
    tiles (16 rows each): the (T, 2d) product is never written out. None for any other layer
    (the float16 and 8-bit forms, merged parts): the caller takes the separate calls."""
    if layer.kernel not in NIBBLE_FORMS or layer.cpu_rows % 32 != 0:
        return None
    args = _nibble_norm_args(layer, x, residual, norm)
    return torch.ops.pagoda_cpu.q4x16_matmul_norm_silu(*args)  # type: ignore[no-any-return]


def _nibble_norm_args(
    layer: Any, x: torch.Tensor, residual: torch.Tensor | None, norm: Any
) -> tuple[Any, ...]:
    """q4x16_matmul_norm's arguments before its adapters' (all of q4x16_matmul_norm_silu's)."""
    form = NIBBLE_FORMS[layer.kernel]
    return (x, residual, norm.weight, norm.eps, layer.packed, layer.cpu_rows, MATMUL_ISA, form)


def cpu_matmul_silu(layer: Any, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
    """cpu_matmul of silu(gate) * up in one call: x (T, 2K), gate | up -> float32 (T, N).
    lora: as cpu_matmul's."""
    ops = torch.ops.pagoda_cpu
    if layer.kernel == "cpu_parts" or layer.kernel in FLOAT16_KERNELS:
        return cpu_matmul(layer, ops.silu_and_mul(x, 2), lora)
    lora_args = _lora_args(lora, x)
    if layer.kernel in NIBBLE_FORMS:
        form = NIBBLE_FORMS[layer.kernel]
        return ops.q4x16_matmul_silu(  # type: ignore[no-any-return]
            x, layer.packed, layer.cpu_rows, MATMUL_ISA, form, *lora_args
        )
    return ops.q8x16_matmul_silu(  # type: ignore[no-any-return]
        x, layer.packed, layer.packed_scales, layer.cpu_rows, MATMUL_ISA, *lora_args
    )
