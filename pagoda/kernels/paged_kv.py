"""The paged KV cache as the attention kernels of pagoda/kernels/attention.py read it: one tile
of keys or values at a time through a sequence's block table (dequantized when the cache is
quantized), and the pointers, strides and constexprs of the cache shared by both kernels'
launches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from pagoda.kernels.paged_cache import KVCache

# tl.dot needs every side >= 16 on the GPU: query heads of a group, tile positions, head_dim.
_MIN_DOT = 16


@triton.jit
def _load_kv_tile(
    ptr,
    scale_ptr,
    block_row_ptr,  # block table row of this sequence
    pos,  # (BLOCK_N,) positions in the sequence
    valid,  # (BLOCK_N,) pos < end: only these are loaded
    kv_head,
    d,  # (BLOCK_D,)
    d_mask,
    stride_b,
    stride_s,
    stride_h,
    stride_sb,
    stride_ss,
    stride_sh,
    out_dtype: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
):
    """(BLOCK_N, BLOCK_D) keys or values at `pos` in `out_dtype`; zeros where not valid."""
    block = tl.load(block_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = pos % BLOCK_SIZE
    row = block * stride_b + slot * stride_s + kv_head * stride_h
    ptrs = ptr + row[:, None] + d[None, :]
    mask = valid[:, None] & d_mask[None, :]
    if QUANT:
        # No `other=`: the interpreter cannot cast a Python 0 to float8; zeroed after the cast.
        x = tl.load(ptrs, mask=mask).to(tl.float32)
        srow = block * stride_sb + slot * stride_ss + kv_head * stride_sh
        s = tl.load(scale_ptr + srow, mask=valid, other=0.0)
        tile = tl.where(mask, x * s[:, None], 0.0).to(out_dtype)
    else:
        # An `else`, not an early return: the compiler still lowers code after a constexpr-if
        # that returns, and an fp8 load cannot take `other=0` (int32 -> fp8e4nv does not cast).
        tile = tl.load(ptrs, mask=mask, other=0).to(out_dtype)
    return tile


def _block_d(head_dim: int) -> int:
    return max(triton.next_power_of_2(head_dim), _MIN_DOT)


def _cache_args(
    cache: KVCache, q: torch.Tensor, out: torch.Tensor
) -> tuple[list[torch.Tensor], list[int], dict[str, int | bool | str]]:
    """Pointers, strides and constexprs shared by both kernels, after checking the layouts."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.k.shape
    num_heads = q.shape[1]
    assert cache.v.shape == cache.k.shape and cache.v.stride() == cache.k.stride()
    assert cache.k.stride(-1) == 1 and q.stride(-1) == 1 and out.stride(-1) == 1
    assert q.shape[2] == head_dim and out.shape[1:] == q.shape[1:]
    assert num_heads % num_kv_heads == 0
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    quant = cache.k_scale is not None and cache.v_scale is not None
    if quant:
        assert cache.k_scale is not None and cache.v_scale is not None
        k_scale, v_scale = cache.k_scale, cache.v_scale
        assert k_scale.stride() == v_scale.stride() and k_scale.dtype == torch.float32
        scale_strides = list(k_scale.stride())
    else:
        k_scale, v_scale = cache.k, cache.v  # never read
        scale_strides = [0, 0, 0]
    strides = [
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *cache.k.stride()[:3],
        *scale_strides,
    ]
    constexprs = dict(
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_SIZE=block_size,
        QUANT=quant,
        # float32: true float32 products (no tf32); ignored for 16-bit inputs.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return [cache.k, cache.v, k_scale, v_scale], strides, constexprs
