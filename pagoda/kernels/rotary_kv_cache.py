"""Triton rotary embedding of q and k fused into the paged KV cache write: one launch per layer
instead of two (pagoda/kernels/rotary.py, then pagoda/kernels/kv_cache.py). Its reference is
those two kernels in sequence (and so `apply_rotary` then the torch write); tests:
tests/unit/test_triton_kernels.py.

One program per token rotates all heads of its query in place (normalized first with Qwen3's
per-head RMSNorm when asked), then writes its key (normalized and rotated on its way) and its
value to its slot exactly as `write_kv_cache` does, quantizing for a quantized cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pagoda.kernels.kv_cache import (
    _MIN_SCALE,
    _ROUND_MAGIC,
    _num_warps,
    _quant_args,
    _rms_norm_halves,
    _write_token_kv,
)
from pagoda.kernels.rotary import _load_angles, _rotate_pair

if TYPE_CHECKING:
    from pagoda.kernels.paged_cache import KVCache


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # unused unless QUANT
    v_scale_ptr,
    slot_mapping_ptr,
    q_norm_ptr,  # (head_dim,) per-head RMSNorm weights of q and k; unused unless QK_NORM
    k_norm_ptr,
    eps,
    block_size,
    num_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_sh,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QK_NORM: tl.constexpr,
    QUANT: tl.constexpr,
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ROUND_MAGIC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    i_mask = i < HALF
    cos, sin = _load_angles(cos_ptr, sin_ptr, t, stride_cos, stride_sin, i, i_mask)
    hq = tl.arange(0, BLOCK_Q_HEADS)[:, None]
    q_mask = (hq < num_heads) & i_mask
    q_row = q_ptr + t * stride_qt + hq * stride_qh + i
    q1 = tl.load(q_row, mask=q_mask, other=0.0)
    q2 = tl.load(q_row + HALF, mask=q_mask, other=0.0)
    if QK_NORM:
        q1, q2 = _rms_norm_halves(q1, q2, q_norm_ptr, i, i_mask, eps, HALF)
    q1, q2 = _rotate_pair(q1, q2, cos, sin)
    tl.store(q_row, q1, mask=q_mask)
    tl.store(q_row + HALF, q2, mask=q_mask)
    _write_token_kv(
        t,
        k_ptr,
        v_ptr,
        slot_mapping_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        cos,
        sin,
        k_norm_ptr,
        eps,
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
        True,
        QK_NORM,
        QUANT,
        IS_INT8,
        QMAX,
        MIN_SCALE,
        ROUND_MAGIC,
    )


def _check_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache,
    slot_mapping: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
) -> None:
    """The shapes, dtypes and strides `rotary_write_kv_cache` requires."""
    num_tokens, _, head_dim = q.shape
    _, num_kv_heads, _ = k.shape
    half = head_dim // 2
    num_blocks, block_size = cache.k.shape[:2]
    assert head_dim % 2 == 0 and k.shape == (num_tokens, num_kv_heads, head_dim)
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert k.dtype == q.dtype and v.dtype == q.dtype
    assert cos.shape == (num_tokens, 1, half) and sin.shape == cos.shape
    assert cos.dtype == q.dtype and sin.dtype == q.dtype
    assert cache.k.shape == (num_blocks, block_size, num_kv_heads, head_dim)
    assert cache.v.shape == cache.k.shape and cache.v.stride() == cache.k.stride()
    assert all(x.stride(-1) == 1 for x in (q, k, v, cos, sin, cache.k))
    if qk_norm is not None:
        for w in qk_norm[:2]:
            assert w.shape == (head_dim,) and w.dtype == q.dtype and w.is_contiguous()


def _stride_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache,
    scale_strides: tuple[int, ...],
) -> list[int]:
    """The kernel's stride arguments, in its order: q, k, v (token, head), cos, sin (token),
    the cache (block, slot, head; v shares k's), its scales (block, slot, head)."""
    return [
        *q.stride()[:2],
        *k.stride()[:2],
        *v.stride()[:2],
        cos.stride(0),
        sin.stride(0),
        *cache.k.stride()[:3],
        *scale_strides[:3],
    ]


def _quant_launch_args(
    cache: KVCache,
) -> tuple[list[torch.Tensor], tuple[int, ...], dict[str, bool | float]]:
    """The k and v scales, their strides and the quantization constexprs of the launch, from
    `_quant_args` (an unquantized cache passes placeholders, never read)."""
    quant, k_scale, v_scale, scale_strides, is_int8, qmax = _quant_args(cache)
    constexprs = dict(
        QUANT=quant, IS_INT8=is_int8, QMAX=qmax, MIN_SCALE=_MIN_SCALE, ROUND_MAGIC=_ROUND_MAGIC
    )
    return [k_scale, v_scale], scale_strides, constexprs


def rotary_write_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache,
    slot_mapping: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """`rotary_qk(q, k, cos, sin)` then `write_kv_cache(k, v, cache, slot_mapping)` in one
    launch, with the same results bit for bit: q is rotated in place, k is rotated on its way
    into the cache and itself left as it was; tokens with a negative slot write nothing.

    qk_norm: (q weight, k weight, eps) of a per-head RMSNorm applied to q and k before the
    rotation (Qwen3), as `rms_norm` over each head's row computes it but for the float32
    reduction order; weights (head_dim,) in q's dtype. q is then normalized and rotated in place.

    q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim); one dtype,
    any token and head strides, last dims contiguous (views into a fused qkv tensor are fine).
    cos, sin: (num_tokens, 1, head_dim // 2) in q's dtype, last dims contiguous, as
    `RotaryEmbedding.cos_sin` returns them. slot_mapping as in `write_kv_cache`.
    """
    _check_args(q, k, v, cos, sin, cache, slot_mapping, qk_norm)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    if num_tokens == 0:
        return
    scales, scale_strides, quant_constexprs = _quant_launch_args(cache)
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (q, q, 0.0)  # placeholders
    block_half = triton.next_power_of_2(half)
    block_q = triton.next_power_of_2(num_heads)
    # (num_tokens,): one program per token: all heads of q, then k and v
    _rotary_write_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        cos,
        sin,
        cache.k,
        cache.v,
        *scales,
        slot_mapping,
        q_norm,
        k_norm,
        eps,
        cache.k.shape[1],  # block_size
        num_heads,
        num_kv_heads,
        *_stride_args(q, k, v, cos, sin, cache, scale_strides),
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_Q_HEADS=block_q,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        QK_NORM=qk_norm is not None,
        **quant_constexprs,
        num_warps=_num_warps(block_q * block_half),
        enable_fp_fusion=False,  # the rotation's roundings, as in rotary_qk
    )
