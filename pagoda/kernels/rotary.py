"""Triton rotary embedding of q and k in place, in one launch. Reference: `apply_rotary` in
pagoda/layers/rotary.py (HF rotate_half layout); tests: tests/unit/test_triton_kernels.py.

Each head vector is split in halves (x1, x2) and rotated pairwise:
    out = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
with cos, sin already in the model dtype. Every product and the sum are rounded to the dtype, as
the reference's dtype arithmetic does, and the kernel is compiled without multiply-add fusion
(`enable_fp_fusion=False`: a fused x1 * cos - x2 * sin would skip one rounding), so results
match the reference bit for bit in every dtype.

The model runs this rotation fused into the KV-cache write (`rotary_write_kv_cache` in
pagoda/kernels/rotary_kv_cache.py, which shares `_rotate_pair`); `rotary_qk` is its unfused
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_pair(x1, x2, cos, sin):
    """The rotated halves (x1 * cos - x2 * sin, x2 * cos + x1 * sin) in x1's dtype, every
    product and the difference / sum rounded to that dtype (cos, sin: float32)."""
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    x1c = (x1 * cos).to(dtype).to(tl.float32)
    x2s = (x2 * sin).to(dtype).to(tl.float32)
    x2c = (x2 * cos).to(dtype).to(tl.float32)
    x1s = (x1 * sin).to(dtype).to(tl.float32)
    return (x1c - x2s).to(dtype), (x2c + x1s).to(dtype)


@triton.jit
def _load_angles(cos_ptr, sin_ptr, t, stride_cos, stride_sin, i, i_mask):
    """Token t's cos and sin at half-indices i (1, BLOCK_HALF), in float32."""
    cos = tl.load(cos_ptr + t * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_sin + i, mask=i_mask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotate_heads(
    ptr,  # this token's head 0
    num_heads,
    stride_h,  # between heads
    cos,  # (1, BLOCK_HALF) float32
    sin,
    i,  # (1, BLOCK_HALF) index in the half
    i_mask,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    h = tl.arange(0, BLOCK_HEADS)[:, None]
    mask = (h < num_heads) & i_mask
    ptr1 = ptr + h * stride_h + i
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0)
    y1, y2 = _rotate_pair(x1, x2, cos, sin)
    tl.store(ptr1, y1, mask=mask)
    tl.store(ptr1 + HALF, y2, mask=mask)


@triton.jit
def _rotary_qk_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    num_heads,
    num_kv_heads,
    stride_q,
    stride_k,
    stride_cos,
    stride_sin,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    i_mask = i < HALF
    cos, sin = _load_angles(cos_ptr, sin_ptr, t, stride_cos, stride_sin, i, i_mask)
    head = 2 * HALF
    _rotate_heads(q_ptr + t * stride_q, num_heads, head, cos, sin, i, i_mask, HALF, BLOCK_Q_HEADS)
    _rotate_heads(
        k_ptr + t * stride_k, num_kv_heads, head, cos, sin, i, i_mask, HALF, BLOCK_K_HEADS
    )


def rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate every head of q and k in place by its token's angles; returns (q, k) themselves.

    q: (num_tokens, num_heads * head_dim), k: (num_tokens, num_kv_heads * head_dim), same dtype,
    any row strides (column slices of one qkv tensor are fine), last dims contiguous.
    cos, sin: (num_tokens, 1, head_dim // 2) in q's dtype, last dims contiguous, as
    `RotaryEmbedding.cos_sin` returns them.
    """
    num_tokens = q.shape[0]
    half = head_dim // 2
    assert head_dim % 2 == 0 and q.shape[1] % head_dim == 0 and k.shape[1] % head_dim == 0
    assert k.shape[0] == num_tokens and k.dtype == q.dtype
    assert cos.shape == (num_tokens, 1, half) and sin.shape == cos.shape
    assert cos.dtype == q.dtype and sin.dtype == q.dtype
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    if num_tokens == 0:
        return q, k
    num_heads = q.shape[1] // head_dim
    num_kv_heads = k.shape[1] // head_dim
    block_half = triton.next_power_of_2(half)
    block_q = triton.next_power_of_2(num_heads)
    block_k = triton.next_power_of_2(num_kv_heads)
    # (num_tokens,): one program per token, all heads of q then k
    _rotary_qk_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        num_heads,
        num_kv_heads,
        q.stride(0),
        k.stride(0),
        cos.stride(0),
        sin.stride(0),
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_Q_HEADS=block_q,
        BLOCK_K_HEADS=block_k,
        num_warps=max(1, min(8, block_q * block_half // 256)),
        enable_fp_fusion=False,
    )
    return q, k
