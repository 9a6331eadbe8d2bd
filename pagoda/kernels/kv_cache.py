"""Triton write of new keys and values into the paged KV cache. Reference: `write_kv_cache` and
`quantize_kv` in pagoda/layers/attention.py; tests: tests/unit/test_triton_kernels.py.

One program per token writes all kv heads of its key and its value to flat slot
`slot_mapping[t]` = block * block_size + offset. A negative slot is a padding row (CUDA-graph
batches padded to a captured size use -1): nothing is written for it.

A quantized cache (int8, float8_e4m3fn) is quantized exactly as `quantize_kv` does it, in float32
with IEEE division (`div_rn`; plain `/` is approximate on the GPU): per (token, head)
scale = max(max|row| / qmax, tiny), values = clamp(x / scale, -qmax, qmax), then rounded half to
even for int8 or cast (round to nearest even) for fp8. Codes and scales match the reference bit
for bit.

The form the model runs, with the rotary embedding of q and k fused into the write, is
`rotary_write_kv_cache` in pagoda/kernels/rotary_kv_cache.py; it shares `_write_token_kv`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pagoda.kernels.paged_cache import KV_SCALE_DTYPE
from pagoda.kernels.rotary import _rotate_pair

if TYPE_CHECKING:
    from pagoda.kernels.paged_cache import KVCache

_MIN_SCALE = torch.finfo(KV_SCALE_DTYPE).tiny
# Adding then subtracting 1.5 * 2**23 rounds a float32 |y| < 2**22 to an integer, half to even
# (IEEE round-to-nearest-even addition; no fast-math reassociation in Triton).
_ROUND_MAGIC = 12582912.0


def _num_warps(block_elems: int) -> int:
    """Warps for a program over `block_elems` elements: about 256 elements per warp, 1 to 8."""
    return max(1, min(8, block_elems // 256))


@triton.jit
def _quantize(xf, scale, IS_INT8: tl.constexpr, QMAX: tl.constexpr, ROUND_MAGIC: tl.constexpr):
    """float32 rows (BLOCK_H, n) / their scales (BLOCK_H,), clamped to [-QMAX, QMAX], rounded
    half to even for int8: the codes before the cast to the cache dtype."""
    y = tl.math.div_rn(xf, scale[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if IS_INT8:
        y = (y + ROUND_MAGIC) - ROUND_MAGIC
    return y


@triton.jit
def _write_halves(
    y1,  # (BLOCK_H, BLOCK_HALF) first halves of this token's head rows, in the model dtype
    y2,  # (BLOCK_H, BLOCK_HALF) second halves
    cache_ptr,
    scale_ptr,
    cache_row,
    scale_row,
    h,  # (BLOCK_H,) kv heads
    i,  # (1, BLOCK_HALF) index in the half
    h_mask,  # (BLOCK_H,) head exists and the slot is not padding
    mask,  # (BLOCK_H, BLOCK_HALF)
    stride_ch,
    stride_sh,
    HALF: tl.constexpr,
    QUANT: tl.constexpr,
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ROUND_MAGIC: tl.constexpr,
):
    dst = cache_ptr + cache_row + h[:, None] * stride_ch + i
    if QUANT:
        f1 = y1.to(tl.float32)
        f2 = y2.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(f1), axis=1), tl.max(tl.abs(f2), axis=1))
        scale = tl.maximum(tl.math.div_rn(amax, QMAX), MIN_SCALE)
        c1 = _quantize(f1, scale, IS_INT8, QMAX, ROUND_MAGIC)
        c2 = _quantize(f2, scale, IS_INT8, QMAX, ROUND_MAGIC)
        tl.store(dst, c1.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, c2.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + scale_row + h * stride_sh, scale, mask=h_mask)
    else:
        tl.store(dst, y1.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, y2.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_halves(x1, x2, w_ptr, i, i_mask, eps, HALF: tl.constexpr):
    """RMSNorm of each row of (BLOCK, 2 * HALF) given as its halves x1, x2, with weight w_ptr
    (2 * HALF,), rounded as `rms_norm` rounds: h32 * rstd to the dtype, then weight * normed."""
    dtype = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    rstd = tl.math.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + i, mask=i_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + i, mask=i_mask, other=0.0).to(tl.float32)
    n1 = (f1 * rstd[:, None]).to(dtype).to(tl.float32)
    n2 = (f2 * rstd[:, None]).to(dtype).to(tl.float32)
    return (w1 * n1).to(dtype), (w2 * n2).to(dtype)


@triton.jit
def _write_token_kv(
    t,  # the token (int64)
    k_ptr,
    v_ptr,
    slot_mapping_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # unused unless QUANT
    v_scale_ptr,
    cos,  # (1, BLOCK_HALF) float32 angles of the token; unused unless ROTATE
    sin,
    k_norm_ptr,  # (2 * HALF,) per-head RMSNorm weight of k; unused unless QK_NORM
    eps,
    block_size,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides (k and v alike): block, offset in block, head
    stride_cs,
    stride_ch,
    stride_sb,  # scale strides (k and v alike): block, offset in block, head
    stride_ss,
    stride_sh,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROTATE: tl.constexpr,
    QK_NORM: tl.constexpr,
    QUANT: tl.constexpr,
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ROUND_MAGIC: tl.constexpr,
):
    """Token t's key (normalized, then rotated, on its way when asked) and value, all kv heads,
    to its slot; nothing for a negative (padding) slot. Head rows go as their two halves, the
    pairs the rotation mixes."""
    i = tl.arange(0, BLOCK_HALF)[None, :]
    i_mask = i < HALF
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, BLOCK_H)
    h_mask = (slot >= 0) & (h < num_kv_heads)
    mask = h_mask[:, None] & i_mask
    cache_row = block * stride_cb + offset * stride_cs
    scale_row = block * stride_sb + offset * stride_ss
    k_row = k_ptr + t * stride_kt + h[:, None] * stride_kh + i
    k1 = tl.load(k_row, mask=mask, other=0.0)
    k2 = tl.load(k_row + HALF, mask=mask, other=0.0)
    if QK_NORM:
        k1, k2 = _rms_norm_halves(k1, k2, k_norm_ptr, i, i_mask, eps, HALF)
    if ROTATE:
        k1, k2 = _rotate_pair(k1, k2, cos, sin)
    _write_halves(
        k1,
        k2,
        k_cache_ptr,
        k_scale_ptr,
        cache_row,
        scale_row,
        h,
        i,
        h_mask,
        mask,
        stride_ch,
        stride_sh,
        HALF,
        QUANT,
        IS_INT8,
        QMAX,
        MIN_SCALE,
        ROUND_MAGIC,
    )
    v_row = v_ptr + t * stride_vt + h[:, None] * stride_vh + i
    _write_halves(
        tl.load(v_row, mask=mask, other=0.0),
        tl.load(v_row + HALF, mask=mask, other=0.0),
        v_cache_ptr,
        v_scale_ptr,
        cache_row,
        scale_row,
        h,
        i,
        h_mask,
        mask,
        stride_ch,
        stride_sh,
        HALF,
        QUANT,
        IS_INT8,
        QMAX,
        MIN_SCALE,
        ROUND_MAGIC,
    )


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # unused unless QUANT
    v_scale_ptr,
    slot_mapping_ptr,
    block_size,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_sh,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QUANT: tl.constexpr,
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ROUND_MAGIC: tl.constexpr,
):
    _write_token_kv(
        tl.program_id(0).to(tl.int64),
        k_ptr,
        v_ptr,
        slot_mapping_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        0.0,  # no angles, no norm
        0.0,
        k_ptr,
        0.0,
        block_size,
        num_kv_heads,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cb,
        stride_cs,
        stride_ch,
        stride_sb,
        stride_ss,
        stride_sh,
        HALF,
        BLOCK_HALF,
        BLOCK_H,
        False,
        False,
        QUANT,
        IS_INT8,
        QMAX,
        MIN_SCALE,
        ROUND_MAGIC,
    )


def _quant_args(
    cache: KVCache,
) -> tuple[bool, torch.Tensor, torch.Tensor, tuple[int, ...], bool, float]:
    """(QUANT, k scales, v scales, their strides, IS_INT8, QMAX) of a write kernel's launch; an
    unquantized cache passes its own tensors as the scales, never read."""
    if cache.k_scale is None or cache.v_scale is None:
        return False, cache.k, cache.v, (0, 0, 0), False, 1.0
    assert cache.k_scale.shape == cache.k.shape[:3]
    assert cache.v_scale.stride() == cache.k_scale.stride()
    is_int8 = cache.k.dtype == torch.int8
    qmax = 127.0 if is_int8 else float(torch.finfo(cache.k.dtype).max)
    return True, cache.k_scale, cache.v_scale, cache.k_scale.stride(), is_int8, qmax


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    """Write token t's key and value rows to flat slot slot_mapping[t] of `cache`, quantizing them
    when the cache is quantized; tokens with a negative slot are skipped.

    k, v: (num_tokens, num_kv_heads, head_dim), any token and head strides, last dim contiguous
    (views into a fused qkv tensor are fine), head_dim even. slot_mapping: (num_tokens,) int64;
    non-negative slots are distinct and < num_blocks * block_size.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    num_blocks, block_size = cache.k.shape[:2]
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert cache.k.shape == (num_blocks, block_size, num_kv_heads, head_dim)
    assert cache.v.shape == cache.k.shape and cache.v.stride() == cache.k.stride()
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and cache.k.stride(-1) == 1
    assert head_dim % 2 == 0  # rows are written as halves, the rotation's pairs
    if num_tokens == 0:
        return
    quant, k_scale, v_scale, scale_strides, is_int8, qmax = _quant_args(cache)
    half = head_dim // 2
    block_h = triton.next_power_of_2(num_kv_heads)
    block_half = triton.next_power_of_2(half)
    # (num_tokens,): one program per token, all heads of k and v
    _write_kv_cache_kernel[(num_tokens,)](
        k,
        v,
        cache.k,
        cache.v,
        k_scale,
        v_scale,
        slot_mapping,
        block_size,
        num_kv_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cache.k.stride(0),
        cache.k.stride(1),
        cache.k.stride(2),
        scale_strides[0],
        scale_strides[1],
        scale_strides[2],
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_H=block_h,
        QUANT=quant,
        IS_INT8=is_int8,
        QMAX=qmax,
        MIN_SCALE=_MIN_SCALE,
        ROUND_MAGIC=_ROUND_MAGIC,
        num_warps=_num_warps(2 * block_h * block_half),
    )
