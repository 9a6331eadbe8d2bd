"""Triton multi-head latent attention (MLA, DeepSeek-V2/V3) over a latent paged cache, in the
absorbed form of pagoda/layers/latent_attention.py (its torch path is the reference; tests:
tests/unit/test_triton_latent_attention.py).

The cache holds one row per token, [latent (RANK values), rotary key (ROPE values)], shared by
every head (KVCache.k (num_blocks, block_size, 1, RANK + ROPE); KVCache.v is empty). A query row
q' (RANK + ROPE) scores a position by q'[:RANK] . latent + q'[RANK:] . rope_key, two dots, so
neither side is padded to a power of two past RANK + ROPE (576 = 512 + 64 for V3); the values are
the latent tile already loaded for the scores, not read again.

Decode is pagoda/kernels/attention.py's split-K scheme (its stage 2 merges the splits): stage 1
runs one program per (sequence, block of BLOCK_H heads, split). Prefill runs one program per
(sequence, BLOCK_M query rows, head), causal over the chunk and its cached context. A quantized
cache (int8, fp8) holds each row with one scale (k_scale), dequantized on load as
`dequantize_kv` does. Launch grids depend on (B, heads, splits) only, as attention.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pagoda.kernels.attention import _LOG2E
from pagoda.kernels.paged_kv import _MIN_DOT, _block_d, _load_kv_tile
from pagoda.kernels.split_k import (
    _launch_decode_stage2,
    _split_scratch,
    _store_split,
    decode_launch_variant,
)

if TYPE_CHECKING:
    from pagoda.kernels.paged_cache import KVCache

_DECODE_BLOCK_H = 16
_DECODE_BLOCK_N = 32
_PREFILL_BLOCK_M = 16  # a 512-wide float32 tile of queries and one of rows: 64 KB of operands
_PREFILL_BLOCK_N = 16


@triton.jit
def _scores(
    q,  # (rows, BLOCK_D) the queries' latent part
    q_pe,  # (rows, BLOCK_R) their rotary part
    k_ptr,
    scale_ptr,
    block_row_ptr,
    pos,
    valid,
    d,
    d_mask,
    r,
    r_mask,
    stride_kb,
    stride_ks,
    stride_sb,
    stride_ss,
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The tile's latent rows (BLOCK_N, BLOCK_D), the values too, and the scores of q against
    [latent, rotary key] (rows, BLOCK_N), in base-2 units; invalid positions -inf."""
    latent = _load_kv_tile(
        k_ptr, scale_ptr, block_row_ptr, pos, valid, 0, d, d_mask,
        stride_kb, stride_ks, 0, stride_sb, stride_ss, 0, q.dtype, BLOCK_SIZE, QUANT,
    )  # fmt: skip
    rope = _load_kv_tile(
        k_ptr, scale_ptr, block_row_ptr, pos, valid, 0, r, r_mask,
        stride_kb, stride_ks, 0, stride_sb, stride_ss, 0, q.dtype, BLOCK_SIZE, QUANT,
    )  # fmt: skip
    s = tl.dot(q, tl.trans(latent), input_precision=PRECISION)
    s += tl.dot(q_pe, tl.trans(rope), input_precision=PRECISION)
    return latent, s * qk_scale


@triton.jit(do_not_specialize=["stride_bt"])
def _latent_decode_kernel(
    q_ptr,
    out_ptr,
    k_ptr,
    scale_ptr,
    token_idx_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    mid_o_ptr,  # (B, num_heads, num_splits, RANK) float32, each split's normalized output
    mid_m_ptr,  # (B, num_heads, num_splits) float32, running max (base-2 units)
    mid_l_ptr,  # (B, num_heads, num_splits) float32, sum of exp2(score - max)
    qk_scale,  # scale * log2(e)
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_sb,
    stride_ss,
    stride_bt,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_D: tl.constexpr,  # RANK padded to a power of two
    BLOCK_R: tl.constexpr,  # ROPE padded likewise
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr,
    PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write out[token] instead of the partials
):
    b = tl.program_id(0)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    pages_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_SIZE), num_splits)
    start = split * pages_per_split * BLOCK_SIZE
    end = tl.minimum(start + pages_per_split * BLOCK_SIZE, seq_len)

    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    d = tl.arange(0, BLOCK_D)
    d_mask = d < RANK
    r = RANK + tl.arange(0, BLOCK_R)
    r_mask = r < RANK + ROPE
    token = tl.load(token_idx_ptr + b).to(tl.int64)
    q_rows = (token * stride_qt + heads * stride_qh)[:, None]
    q = tl.load(q_ptr + q_rows + d[None, :], mask=h_mask[:, None] & d_mask[None, :], other=0)
    q_pe = tl.load(q_ptr + q_rows + r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0)
    block_row_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    sum_exp = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        latent, s = _scores(
            q, q_pe, k_ptr, scale_ptr, block_row_ptr, pos, valid, d, d_mask, r, r_mask,
            stride_kb, stride_ks, stride_sb, stride_ss, qk_scale, BLOCK_SIZE, QUANT, PRECISION,
        )  # fmt: skip
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        sum_exp = sum_exp * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=PRECISION)
        m = m_new

    _store_split(
        out_ptr, mid_o_ptr, mid_m_ptr, mid_l_ptr, acc, m, sum_exp, token, b, heads, h_mask, d,
        d_mask, split, num_splits, num_heads, stride_ot, stride_oh, RANK, DIRECT,
    )  # fmt: skip


@triton.jit(do_not_specialize=["stride_bt"])
def _latent_prefill_kernel(
    q_ptr,
    out_ptr,
    k_ptr,
    scale_ptr,
    token_start_ptr,
    query_lens_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,  # scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_sb,
    stride_ss,
    stride_bt,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # positions per tile, a multiple of BLOCK_SIZE
    QUANT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    query_len = tl.load(query_lens_ptr + seq).to(tl.int32)
    if tile * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - query_len

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < query_len
    q_pos = context_len + rows  # (BLOCK_M,) position of each query row
    tokens = tl.load(token_start_ptr + seq).to(tl.int64) + rows
    d = tl.arange(0, BLOCK_D)
    d_mask = d < RANK
    r = RANK + tl.arange(0, BLOCK_R)
    r_mask = r < RANK + ROPE
    q_rows = (tokens * stride_qt + head * stride_qh)[:, None]
    q = tl.load(q_ptr + q_rows + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0)
    q_pe = tl.load(q_ptr + q_rows + r[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0)
    block_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # Causal: the last row of this tile sees keys [0, context_len + (tile + 1) * BLOCK_M).
    end = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_M)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    sum_exp = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        latent, s = _scores(
            q, q_pe, k_ptr, scale_ptr, block_row_ptr, pos, valid, d, d_mask, r, r_mask,
            stride_kb, stride_ks, stride_sb, stride_ss, qk_scale, BLOCK_SIZE, QUANT, PRECISION,
        )  # fmt: skip
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # every row sees position 0: finite from tile 0
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        sum_exp = sum_exp * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=PRECISION)
        m = m_new

    o = acc / tl.where(sum_exp > 0, sum_exp, 1.0)[:, None]
    tl.store(
        out_ptr + (tokens * stride_ot + head * stride_oh)[:, None] + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def _latent_args(
    cache: KVCache, q: torch.Tensor, out: torch.Tensor, rank: int
) -> tuple[list[torch.Tensor], list[int], dict[str, int | bool | str]]:
    """The cache's pointers (rows, row scales), strides and the constexprs both kernels share."""
    num_blocks, block_size, one, width = cache.k.shape
    assert one == 1 and cache.v.shape[-1] == 0, "a latent cache: one row per token, no values"
    assert q.shape[2] == width and out.shape[2] == rank and out.shape[:2] == q.shape[:2]
    assert cache.k.stride(-1) == 1 and q.stride(-1) == 1 and out.stride(-1) == 1
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    rope = width - rank
    assert rope >= 1
    quant = cache.k_scale is not None
    scale = cache.k_scale if cache.k_scale is not None else cache.k  # never read unquantized
    scale_strides = list(scale.stride()[:2]) if quant else [0, 0]
    strides = [*cache.k.stride()[:2], *scale_strides]
    constexprs = dict(
        RANK=rank,
        ROPE=rope,
        BLOCK_D=_block_d(rank),
        BLOCK_R=max(triton.next_power_of_2(rope), _MIN_DOT),
        BLOCK_SIZE=block_size,
        QUANT=quant,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return [cache.k, scale], strides, constexprs


def latent_decode_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    cache: KVCache,
    token_idx: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
) -> None:
    """One absorbed query row per sequence (q (num_tokens, H, RANK + ROPE)) over its rows
    [0, seq_len) -> out (num_tokens, H, RANK) at rows token_idx; the arguments as
    attention.paged_decode_attention's (seq_len 0: a padding row, zeros)."""
    batch = token_idx.shape[0]
    if batch == 0:
        return
    assert num_splits >= 1
    assert block_tables.shape[0] == seq_lens.shape[0] == batch and block_tables.stride(1) == 1
    rank = out.shape[2]
    ptrs, strides, constexprs = _latent_args(cache, q, out, rank)
    num_heads = q.shape[1]
    direct, block_s = decode_launch_variant(num_splits)
    if direct:
        mid_o = mid_m = mid_l = out  # never written
    else:
        mid_o, mid_m, mid_l = _split_scratch(batch, num_heads, num_splits, rank, q.device)
    grid = (batch, triton.cdiv(num_heads, _DECODE_BLOCK_H), num_splits)
    _latent_decode_kernel[grid](
        q,
        out,
        *ptrs,
        token_idx,
        block_tables,
        seq_lens,
        mid_o,
        mid_m,
        mid_l,
        scale * _LOG2E,
        num_heads,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *strides,
        block_tables.stride(0),
        BLOCK_H=_DECODE_BLOCK_H,
        BLOCK_N=max(cache.k.shape[1], _DECODE_BLOCK_N),
        DIRECT=direct,
        **constexprs,
        num_warps=4,
    )
    if not direct:
        _launch_decode_stage2(out, token_idx, mid_o, mid_m, mid_l, num_splits, block_s)


def latent_prefill_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    cache: KVCache,
    token_start: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> None:
    """Causal absorbed attention of chunked prefills, each query row over the rows [0, its
    position]; the arguments as attention.paged_prefill_attention's, out (num_tokens, H, RANK)."""
    num_seqs = token_start.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return
    assert query_lens.shape[0] == seq_lens.shape[0] == block_tables.shape[0] == num_seqs
    assert block_tables.stride(1) == 1
    ptrs, strides, constexprs = _latent_args(cache, q, out, out.shape[2])
    grid = (num_seqs, triton.cdiv(max_query_len, _PREFILL_BLOCK_M), q.shape[1])
    _latent_prefill_kernel[grid](
        q,
        out,
        *ptrs,
        token_start,
        query_lens,
        seq_lens,
        block_tables,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *strides,
        block_tables.stride(0),
        BLOCK_M=_PREFILL_BLOCK_M,
        BLOCK_N=max(cache.k.shape[1], _PREFILL_BLOCK_N),
        **constexprs,
        num_warps=4,
    )
