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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pagoda.config import KV_SCALE_DTYPE

if TYPE_CHECKING:
    from pagoda.layers.attention import KVCache

_MIN_SCALE = torch.finfo(KV_SCALE_DTYPE).tiny
# Adding then subtracting 1.5 * 2**23 rounds a float32 |y| < 2**22 to an integer, half to even
# (IEEE round-to-nearest-even addition; no fast-math reassociation in Triton).
_ROUND_MAGIC = 12582912.0


def _num_warps(block_elems: int) -> int:
    """Warps for a program over `block_elems` elements: about 256 elements per warp, 1 to 8."""
    return max(1, min(8, block_elems // 256))


@triton.jit
def _write_one(
    x_ptr,  # this token's (num_kv_heads, head_dim) rows
    cache_ptr,
    scale_ptr,
    cache_row,  # int64 offset of (block, offset, head 0) in the cache
    scale_row,  # int64 offset of (block, offset, head 0) in the scales
    h,  # (BLOCK_H,) kv heads
    d,  # (BLOCK_D,)
    h_mask,  # (BLOCK_H,) head exists and the slot is not padding
    mask,  # (BLOCK_H, BLOCK_D)
    stride_xh,
    stride_ch,
    stride_sh,
    QUANT: tl.constexpr,
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ROUND_MAGIC: tl.constexpr,
):
    x = tl.load(x_ptr + h[:, None] * stride_xh + d[None, :], mask=mask, other=0.0)
    dst = cache_ptr + cache_row + h[:, None] * stride_ch + d[None, :]
    if QUANT:
        xf = x.to(tl.float32)
        amax = tl.max(tl.abs(xf), axis=1)  # (BLOCK_H,)
        scale = tl.maximum(tl.math.div_rn(amax, QMAX), MIN_SCALE)
        y = tl.math.div_rn(xf, scale[:, None])
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if IS_INT8:
            y = (y + ROUND_MAGIC) - ROUND_MAGIC
        tl.store(dst, y.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + scale_row + h * stride_sh, scale, mask=h_mask)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


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
    head_dim,
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
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ROUND_MAGIC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = (slot >= 0) & (h < num_kv_heads)
    mask = h_mask[:, None] & (d[None, :] < head_dim)
    cache_row = block * stride_cb + offset * stride_cs
    scale_row = block * stride_sb + offset * stride_ss
    _write_one(
        k_ptr + t * stride_kt,
        k_cache_ptr,
        k_scale_ptr,
        cache_row,
        scale_row,
        h,
        d,
        h_mask,
        mask,
        stride_kh,
        stride_ch,
        stride_sh,
        QUANT,
        IS_INT8,
        QMAX,
        MIN_SCALE,
        ROUND_MAGIC,
    )
    _write_one(
        v_ptr + t * stride_vt,
        v_cache_ptr,
        v_scale_ptr,
        cache_row,
        scale_row,
        h,
        d,
        h_mask,
        mask,
        stride_vh,
        stride_ch,
        stride_sh,
        QUANT,
        IS_INT8,
        QMAX,
        MIN_SCALE,
        ROUND_MAGIC,
    )


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    """Write token t's key and value rows to flat slot slot_mapping[t] of `cache`, quantizing them
    when the cache is quantized; tokens with a negative slot are skipped.

    k, v: (num_tokens, num_kv_heads, head_dim), any token and head strides, last dim contiguous
    (views into a fused qkv tensor are fine). slot_mapping: (num_tokens,) int64; non-negative slots
    are distinct and < num_blocks * block_size.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    num_blocks, block_size = cache.k.shape[:2]
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert cache.k.shape == (num_blocks, block_size, num_kv_heads, head_dim)
    assert cache.v.shape == cache.k.shape and cache.v.stride() == cache.k.stride()
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and cache.k.stride(-1) == 1
    if num_tokens == 0:
        return
    quant = cache.k_scale is not None and cache.v_scale is not None
    if quant:
        assert cache.k_scale is not None and cache.v_scale is not None
        assert cache.k_scale.shape == cache.k.shape[:3]
        assert cache.v_scale.stride() == cache.k_scale.stride()
        k_scale, v_scale = cache.k_scale, cache.v_scale
        is_int8 = cache.k.dtype == torch.int8
        qmax = 127.0 if is_int8 else float(torch.finfo(cache.k.dtype).max)
        scale_strides = k_scale.stride()
    else:
        k_scale, v_scale = cache.k, cache.v  # placeholders, never read
        is_int8, qmax, scale_strides = False, 1.0, (0, 0, 0)
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
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
        head_dim,
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
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        QUANT=quant,
        IS_INT8=is_int8,
        QMAX=qmax,
        MIN_SCALE=_MIN_SCALE,
        ROUND_MAGIC=_ROUND_MAGIC,
        num_warps=_num_warps(block_h * block_d),
    )
