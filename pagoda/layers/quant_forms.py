"""The weight forms of quantized layers: how integer weights are quantized and packed, the
buffers a quantization method leaves on its layer, and the matmul over them. The methods that
choose a form per scheme are in pagoda/layers/quant.py.

Two kernel forms serve every integer scheme (torch's packed CPU ops; bf16 activations):

    int4 (group g):  w[n, k] = (code[n, k] - 8) * scale[n, k // g] + zero[n, k // g]
                     codes packed by _convert_weight_to_int4pack_for_cpu, (scale, zero) bf16
                     GGUF Q4_0 / Q4_1 / Q4_K (g = 32), int4 (g = 128, 64 or 32), AWQ, GPTQ
    int8 (group 32): w[n, k] = code[n, k] * scale[n, k // 32], code = 16 hi + lo, run as the
                     int4 op over both halves stacked along N: int8, GGUF Q8_0
    int8 (per row):  w[n, k] = code[n, k] * scale[n]   (_weight_int8pack_mm)
                     embeddings and LM heads, GGUF Q6_K / others (re-quantized per row)

On CUDA the same three forms run as Triton kernels (pagoda/kernels/quant_matmul.py), from codes
kept quantized; scales and zero points in the model's dtype:

    w4a16 (kernel "w4a16"):  qweight (N, K // 2) uint8, byte j = code[2j] | code[2j + 1] << 4,
                             scale, zero (N, K // g); every int4 form above
    w8a16 (kernel "w8a16"):  qweight (N, K) int8, scale (N, K // g); int8 and Q8_0 groups
    int8 rows (kernel "int8"): qweight (N, K) int8, weight_scale (N,), as on CPU

On CPU, where pagoda's C++ kernels build (pagoda/kernels/cpu) and PAGODA_CPU_KERNELS is not 0,
GGUF layers (Q4_0 / Q4_1, Q5_0, Q4_K, Q6_K, Q8_0) and the int8 rows keep the kernels' form instead of
torch's: codes in tiles of 16 rows laid out for VNNI dot products, multiplied against
int8-quantized activations, for every step size (pagoda/kernels/cpu/quant_gemm.cpp):

    cpu_q4:  packed (ceil(N / 16), K // 32, 320) uint8, w = scale * code + offset (fp16)
    cpu_q5:  packed (ceil(N / 16), K // 32, 352) uint8, w = scale * (code - 16) (GGUF Q5_0,
             its bytes: low nibbles, a bit plane of fifth bits, fp16 scales)
    cpu_q4k: packed (ceil(N / 16), K // 256, 2368) uint8, GGUF Q4_K's own numbers (its bytes,
             the 6-bit sub-scales a byte each: x1.03)
    cpu_q6k: packed (ceil(N / 16), K // 256, 3360) uint8, GGUF Q6_K's own numbers and bytes
    cpu_q8:  packed (ceil(N / 16), K // 32, 512) uint8 (code + 128), packed_scales float32
             (ceil(N / 16), K // 32 or 1, 16): w = scale * code, per group or per row

GPTQ act-order (g_idx not sorted) permutes input channels so groups are contiguous and applies the
same permutation to x (`perm`). On devices other than CPU and CUDA the integer schemes dequantize
before the matmul (correct, not fast).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# Kernels


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)


def int4_supported(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether torch's packed int4 op takes this shape (rows in 16s, whole groups)."""
    return out_features % 16 == 0 and in_features % group_size == 0 and group_size % 32 == 0


def int4_pack(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """codes (N, K) in [0, 15], scale / zero (N, K // g) -> (packed weight, scale_zeros (K // g, N, 2))."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.to(torch.int32).cpu().contiguous(), 1
    )
    scale_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scale_zeros


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    # x: (M, K) -> (M, N) in x's dtype
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(_bf16(x), packed, group_size, scale_zeros)
    return y.to(x.dtype)


def int4_dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The reference: float32 (N, K) from the unpacked form."""
    s = scale.float().repeat_interleave(group_size, dim=1)
    z = zero.float().repeat_interleave(group_size, dim=1)
    return (codes.float() - 8) * s + z


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x: (M, K), codes: (N, K) int8, scale: (N,) bf16 -> (M, N) in x's dtype
    return torch.ops.aten._weight_int8pack_mm(_bf16(x), codes, scale).to(x.dtype)


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (codes (N, K) int8, scale (N,) float32), w ~ codes * scale."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scale


def quantize_int8_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group-wise int8: (codes (N, K) int8, scale (N, K // g)), w ~ codes * scale."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    scale = g.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    codes = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(n, k), scale


def split_int8_groups(
    codes: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise int8 as two int4 halves stacked along N, for the int4 kernel:
    c = 16 * hi + lo with hi in [-8, 7], lo in [0, 15], so
    w = c * s = (hi + 8 - 8) * 16 s + 0  +  (lo - 8) * s + 8 s.
    Returns (codes (2N, K), scale (2N, G), zero (2N, G)); y = y[:, :N] + y[:, N:]."""
    c = codes.to(torch.int16)
    hi = torch.div(c, 16, rounding_mode="floor")
    lo = c - 16 * hi
    half_codes = torch.cat([hi + 8, lo]).to(torch.uint8)
    half_scale = torch.cat([16 * scale, scale])
    half_zero = torch.cat([torch.zeros_like(scale), 8 * scale])
    return half_codes, half_scale, half_zero


def quantize_int4_groups(
    w: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise 4-bit (min-max, float zero point, as GGUF Q4_1) in the int4
    kernel's form: (codes, scale, zero) with w ~ (codes - 8) * scale + zero."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo = g.amin(dim=-1)
    scale = ((g.amax(dim=-1) - lo) / 15.0).clamp(min=1e-12)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return codes.reshape(n, k).to(torch.uint8), scale, lo + 8 * scale


# ---------------------------------------------------------------------------------------------
# Stored forms a method leaves on its layer (buffers, so .to(device) and memory counts see them)


def triton_weights(device: torch.device) -> bool:
    """Whether integer weights on `device` take the Triton kernels' forms (CUDA)."""
    return device.type == "cuda"


def set_int4(
    layer: Any,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None = None,
) -> None:
    device = layer.device
    if triton_weights(device):
        from pagoda.kernels.quant_matmul import pack_int4

        layer.register_buffer("qweight", pack_int4(codes).to(device))
        layer.register_buffer("scale", scale.to(layer.dtype).to(device).contiguous())
        layer.register_buffer("zero", zero.to(layer.dtype).to(device).contiguous())
        layer.register_buffer("perm", None if perm is None else perm.to(device))
        layer.group_size = group_size
        layer.kernel = "w4a16"
        return
    if device.type == "cpu":
        packed, scale_zeros = int4_pack(codes, scale, zero)
        layer.register_buffer("qweight", packed)
        layer.register_buffer("scale_zeros", scale_zeros)
    else:  # no packed kernel here yet: keep the dequantized weight
        set_dense(layer, int4_dequantize(codes, scale, zero, group_size))
    layer.register_buffer("perm", None if perm is None else perm.to(device))
    layer.group_size = group_size
    layer.kernel = "int4"


def set_int8_groups(layer: Any, codes: torch.Tensor, scale: torch.Tensor, group_size: int) -> None:
    """Group-wise int8 (Q8_0-like): on CPU run as two int4 halves in one packed matrix."""
    device = layer.device
    if triton_weights(device):
        layer.register_buffer("qweight", codes.to(torch.int8).to(device).contiguous())
        layer.register_buffer("scale", scale.to(layer.dtype).to(device).contiguous())
        layer.group_size = group_size
        layer.kernel = "w8a16"
        return
    if device.type != "cpu":
        set_dense(layer, codes.float() * scale.repeat_interleave(group_size, dim=1))
        return
    set_int4(layer, *split_int8_groups(codes, scale), group_size)
    layer.kernel = "int8x2"


def set_dense(layer: Any, w: torch.Tensor) -> None:
    """A dequantized weight, for devices without a packed op (kernel "int4", no scales)."""
    layer.register_buffer("qweight", w.to(layer.dtype).to(layer.device))
    layer.register_buffer("scale_zeros", None)
    layer.register_buffer("perm", None)
    layer.kernel = "int4"


def set_int8(layer: Any, w: torch.Tensor) -> None:
    codes, scale = quantize_int8_rows(w)
    if set_cpu_q8(layer, codes, scale[:, None]):
        return
    device = layer.device
    # The CPU op takes bf16 scales; the CUDA kernel any float (kept in the model's dtype).
    scale_dtype = layer.dtype if triton_weights(device) else torch.bfloat16
    layer.register_buffer("qweight", codes.to(device))
    layer.register_buffer("weight_scale", scale.to(scale_dtype).to(device))
    layer.kernel = "int8"


def cpu_kernels_for(layer: Any) -> Any | None:
    """torch.ops.pagoda_cpu where the layer lives on CPU in torch's forms (not the Triton
    kernels') and the kernels are built and enabled, else None."""
    if layer.device.type != "cpu" or triton_weights(layer.device):
        return None
    from pagoda.kernels.cpu import kernels

    return kernels()


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


def pack_q4x16(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The CPU kernels' 4-bit form, w = scale * code + offset per group of 32: codes (N, K) in
    [0, 15], scale and offset (N, K // 32) -> uint8 (ceil(N / 16), K // 32, 320), per tile of 16
    rows and group: 4 blocks of 64 bytes (block s, byte 4j + b: row j's code 8s + b in the low
    nibble, 8s + 4 + b in the high one), then the 16 scales and the 16 offsets as fp16 (N padded
    with zero rows). ValueError where a scale or offset does not fit fp16."""
    n, k = codes.shape
    groups, pad = k // 32, -n % 16
    tiles = (n + pad) // 16
    half = F.pad(torch.stack([scale, offset]).to(torch.float16), (0, 0, 0, pad))  # (2, N', G)
    if not torch.isfinite(half).all():
        raise ValueError("4-bit scales or offsets beyond fp16's range")
    code_part = _nibble_blocks(codes, tiles)
    sd = half.view(2, tiles, 16, groups).permute(1, 3, 0, 2).contiguous()  # (T, G, 2, 16)
    return torch.cat([code_part, sd.view(torch.uint8).reshape(tiles, groups, 64)], -1).contiguous()


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
    False where the kernels are off or a scale does not fit fp16 (the caller keeps torch's form).
    fp16 holds Q4_0 / Q4_1's scales exactly (the file's) and rounds Q4_K's products of a scale
    and a 6-bit sub-scale to 11 bits (torch's form keeps 8: bf16)."""
    if cpu_kernels_for(layer) is None:
        return False
    try:
        packed = pack_q4x16(codes, scale.float(), offset.float())
    except ValueError:
        return False
    layer.register_buffer("packed", packed)
    layer.cpu_rows = codes.shape[0]
    layer.kernel = "cpu_q4"
    return True


def pack_q5x16(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The CPU kernels' 5-bit form, w = scale * (code - 16) per group of 32: codes (N, K) in
    [0, 31], scale (N, K // 32) (fp16 values: Q5_0's d) -> uint8 (ceil(N / 16), K // 32, 352),
    per tile of 16 rows and group: the low nibbles as pack_q4x16's 4 blocks of 64 bytes, then 8
    masks of 64 bits (mask 2s + h, bit 4j + b: the fifth bit of row j's code 8s + 4h + b), then
    the 16 scales as fp16 (N padded with zero rows)."""
    n, k = codes.shape
    groups, pad = k // 32, -n % 16
    tiles = (n + pad) // 16
    c = F.pad(codes.to(torch.uint8), (0, 0, 0, pad)).view(tiles, 16, groups, 4, 2, 4)
    code_part = _nibble_blocks(codes, tiles)
    fifth = (c >> 4).permute(0, 2, 3, 4, 1, 5).reshape(tiles, groups, 8, 8, 8)  # mask, byte, bit
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32)
    masks = (fifth.to(torch.int32) * weights).sum(-1).to(torch.uint8).view(tiles, groups, 64)
    half = F.pad(scale.to(torch.float16), (0, 0, 0, pad)).view(tiles, 16, groups)
    scales = half.permute(0, 2, 1).contiguous().view(torch.uint8).reshape(tiles, groups, 32)
    return torch.cat([code_part, masks, scales], -1).contiguous()


def pack_q4kx16(
    codes: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
) -> torch.Tensor:
    """The CPU kernels' Q4_K form, w = d * sc[g] * code - dmin * m[g]: codes (N, K) in [0, 15];
    sc, m (N, K // 32) in [0, 63]; d, dmin (N, K // 256) fp16 -> uint8 (ceil(N / 16), K // 256,
    2368), per tile of 16 rows and super-block of 8 groups: the groups' nibble blocks
    (pack_q4x16's), then per group the 16 rows' sc, then their m, a byte each, then the 16 d
    and the 16 -dmin as fp16. 148 bytes a row and 256 values: the file's 144, its 6-bit numbers
    unpacked to a byte each (quant_gemm.cpp says why)."""
    n, k = codes.shape
    tiles, supers = -(-n // 16), k // 256
    code_part = _nibble_blocks(codes, tiles).reshape(tiles, supers, 2048)
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


def set_cpu_k(layer: Any, k: Any) -> bool:
    """Leave the CPU kernels' Q4_K or Q6_K form on the layer (k: layers/gguf.KQuantCodes, the
    file's own numbers); False where the kernels are off."""
    if cpu_kernels_for(layer) is None:
        return False
    if k.qtype == "Q4_K":
        packed, kernel = pack_q4kx16(k.codes, k.sc, k.m, k.d, k.dmin), "cpu_q4k"
    else:
        packed, kernel = pack_q6kx16(k.codes, k.sc, k.d), "cpu_q6k"
    layer.register_buffer("packed", packed)
    layer.cpu_rows = k.codes.shape[0]
    layer.kernel = kernel
    return True


def set_cpu_q5(layer: Any, codes: torch.Tensor, scale: torch.Tensor) -> bool:
    """Leave the CPU kernels' 5-bit form on the layer (w = scale * (code - 16), codes in
    [0, 31], groups of 32: GGUF Q5_0's bytes); False where the kernels are off."""
    if cpu_kernels_for(layer) is None:
        return False
    layer.register_buffer("packed", pack_q5x16(codes, scale))
    layer.cpu_rows = codes.shape[0]
    layer.kernel = "cpu_q5"
    return True


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


def set_cpu_q8(layer: Any, codes: torch.Tensor, scale: torch.Tensor) -> bool:
    """Leave the CPU kernels' 8-bit form on the layer (w = scale * code; scale (N, K // 32) or
    (N, 1)); False where the kernels are off."""
    if cpu_kernels_for(layer) is None:
        return False
    packed, scales = pack_q8x16(codes.to(torch.int8), scale)
    layer.register_buffer("packed", packed)
    layer.register_buffer("packed_scales", scales)
    layer.cpu_rows = codes.shape[0]
    layer.kernel = "cpu_q8"
    return True


def cpu_q8_rows(layer: Any, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a "cpu_q8" layer's weight, float32 (the embedding's lookup)."""
    tiles, groups, _ = layer.packed.shape
    tile, lane = ids // 16, ids % 16
    codes = layer.packed.view(tiles, groups, 8, 16, 4)[tile, :, :, lane, :]  # (n, G, 8, 4)
    codes = codes.reshape(ids.shape[0], groups, 32).to(torch.int16) - 128
    scales = layer.packed_scales[tile, :, lane]  # (n, G or 1)
    return (codes * scales[..., None]).reshape(ids.shape[0], groups * 32)


# The kernel forms of pagoda's CPU kernels: the nibble ones (4-bit, 5-bit, Q4_K, Q6_K) run the
# q4x16 ops (which tell them apart by their unit's bytes), cpu_q8 the q8x16 ones.
Q4X16_KERNELS = ("cpu_q4", "cpu_q5", "cpu_q4k", "cpu_q6k")
CPU_KERNELS = (*Q4X16_KERNELS, "cpu_q8", "cpu_parts")


def cpu_matmul(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """x @ w^T on pagoda's CPU kernels: x (..., K) -> float32 (..., N)."""
    ops = torch.ops.pagoda_cpu
    rows = x.reshape(-1, x.shape[-1])
    if layer.kernel == "cpu_parts":
        y = torch.cat([cpu_matmul(p, rows) for p in layer.parts], -1)
    elif layer.kernel in Q4X16_KERNELS:
        y = ops.q4x16_matmul(rows, layer.packed, layer.cpu_rows, 2)
    else:
        y = ops.q8x16_matmul(rows, layer.packed, layer.packed_scales, layer.cpu_rows, 2)
    return y.view(*x.shape[:-1], layer.cpu_rows)


def cpu_matmul_norm(
    layer: Any, x: torch.Tensor, residual: torch.Tensor | None, norm: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """cpu_matmul of norm(x + residual) and x + residual (x where residual is None), in one
    call: x, residual (T, K); norm a RMSNorm -> (float32 (T, N), (T, K)). cpu_parts: the
    norm's op, then each part's matmul."""
    ops = torch.ops.pagoda_cpu
    if layer.kernel == "cpu_parts":
        normed, hidden = ops.add_rms_norm(x, residual, norm.weight, norm.eps, 2)
        return cpu_matmul(layer, normed), hidden
    if layer.kernel in Q4X16_KERNELS:
        return ops.q4x16_matmul_norm(  # type: ignore[no-any-return]
            x, residual, norm.weight, norm.eps, layer.packed, layer.cpu_rows, 2
        )
    return ops.q8x16_matmul_norm(  # type: ignore[no-any-return]
        x, residual, norm.weight, norm.eps, layer.packed, layer.packed_scales, layer.cpu_rows, 2
    )


def cpu_matmul_silu(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """cpu_matmul of silu(gate) * up in one call: x (T, 2K), gate | up -> float32 (T, N)."""
    ops = torch.ops.pagoda_cpu
    if layer.kernel == "cpu_parts":
        return cpu_matmul(layer, ops.silu_and_mul(x, 2))
    if layer.kernel in Q4X16_KERNELS:
        return ops.q4x16_matmul_silu(x, layer.packed, layer.cpu_rows, 2)  # type: ignore[no-any-return]
    return ops.q8x16_matmul_silu(  # type: ignore[no-any-return]
        x, layer.packed, layer.packed_scales, layer.cpu_rows, 2
    )


def take_float_weight(module: Any) -> torch.Tensor:
    """Remove a module's float `weight` parameter and return its data; the module keeps its
    device and dtype (`device`, `dtype`) for the stored form that replaces it."""
    w = module.weight.data
    module.device = w.device
    module.dtype = w.dtype
    del module.weight
    return w


def apply_stored(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """The matmul of whatever `set_int4` / `set_int8` left on the layer (no bias)."""
    if layer.kernel in CPU_KERNELS:
        return cpu_matmul(layer, x).to(x.dtype)
    if layer.kernel == "float":
        return F.linear(x, layer.weight)
    if layer.kernel == "w4a16":
        from pagoda.kernels.quant_matmul import w4a16_matmul

        if layer.perm is not None:
            x = x.index_select(-1, layer.perm)
        return w4a16_matmul(x, layer.qweight, layer.scale, layer.zero, layer.group_size)
    if layer.kernel == "w8a16":
        from pagoda.kernels.quant_matmul import w8a16_matmul

        return w8a16_matmul(x, layer.qweight, layer.scale, layer.group_size)
    if layer.kernel == "int8x2":
        y = int4_matmul(x, layer.qweight, layer.scale_zeros, layer.group_size)
        n = y.shape[-1] // 2
        return y[..., :n] + y[..., n:]
    if layer.kernel == "int4":
        if layer.perm is not None:
            x = x.index_select(-1, layer.perm)
        if layer.scale_zeros is None:
            return F.linear(x, layer.qweight)
        return int4_matmul(x, layer.qweight, layer.scale_zeros, layer.group_size)
    if triton_weights(x.device):
        from pagoda.kernels.quant_matmul import w8a16_matmul

        scale = layer.weight_scale[:, None]  # (N, 1): one group of K per row
        return w8a16_matmul(x, layer.qweight, scale, layer.qweight.shape[1])
    if x.device.type == "cpu":
        return int8_matmul(x, layer.qweight, layer.weight_scale)
    return F.linear(x, layer.qweight.to(x.dtype) * layer.weight_scale.to(x.dtype)[:, None])


def stored_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of a module tree, each tensor counted once."""
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
