"""Triton paged attention: decode (split-K, flash-decoding) and chunked prefill, over the paged
KV cache of pagoda/layers/attention.py. Reference: `paged_attention_torch` there; tests:
tests/unit/test_triton_attention.py.

Both kernels read keys and values only through block tables (pagoda/kernels/paged_kv.py), one
tile of BLOCK_N positions at a time. BLOCK_N is a whole number of pages (max(block_size, 32) in
decode, max(block_size, 64) in prefill) and a tile looks up the block id of each of its
positions, so any power-of-two block_size from 1 to 128 meets tl.dot's minimum of 16 on every
side (head_dim is padded to BLOCK_D >= 16 with masks; decode pads a GQA group's query heads to
BLOCK_H >= 16 rows). Positions past a sequence's length are never loaded, so table entries there
may be garbage. Block ids are widened to int64 before they meet a stride.

Decode stage 1 runs one program per (sequence, kv head, split) over all query heads of that kv
head's group, so each key tile is read once per group. Prefill runs one program per (sequence,
BLOCK_M query rows, head) and reads pages only up to its last row's position (causal).

Sliding window (`window` > 0): the query at position p attends to keys [p - window + 1, p]. Decode
splits the pages from the one holding seq_len - window on; prefill starts at the tile holding
its first row's window start; positions before a row's window are masked. window 0: full
attention, the same loads and arithmetic as without a window. The window is not specialized on
(a model's windows make no kernel variants of their own).

A quantized cache (int8, float8_e4m3fn) is dequantized in the kernel exactly as `dequantize_kv`
does: values.float() * scale, cast to the query dtype, then the dot.

Softmax runs in base 2: scores are multiplied by scale * log2(e) and the running max of each
split is kept in those units; the decode merge uses the same units.

Decode, split s of S for a sequence with n pages, P = cdiv(n, S) (under a window, pages
counted from the one holding seq_len - window):

    pages    | 0 ... P-1 | P ... 2P-1 | ... | (S-1)P ... n-1 |   (a split past n has no pages)
    stage 1  | split 0   | split 1    | ... | split S-1      |   -> partial out, max, sum-exp
    stage 2  merge the S partials by log-sum-exp -> out[token_idx[b]]

P is computed in the kernel from seq_lens: the launch grids depend only on (B, num_kv_heads,
num_splits) and (B, num_heads), never on sequence lengths, so a decode step can be captured in
a CUDA graph and replayed with other lengths.

Triton compiles a kernel once per set of constexprs and specialized integers (an int argument
equal to 1 or divisible by 16 makes its own variant). The integers that change from step to step
(the block tables' row stride, the split count) are not specialized, so the variants a served
step can need are those of `decode_launch_variant` (the prefill kernel has one); the runner's
warm-up (pagoda/runner/kernel_warmup.py) makes each of them before the first request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pagoda.kernels.paged_kv import _MIN_DOT, _cache_args, _load_kv_tile
from pagoda.kernels.split_k import (
    _launch_decode_stage2,
    _split_scratch,
    _store_split,
    decode_launch_variant,
)

if TYPE_CHECKING:
    from pagoda.kernels.paged_cache import KVCache

_LOG2E = 1.4426950408889634

# decode_num_splits aims at this many stage-1 programs: two waves on an H100 SXM (132 SMs).
_TARGET_PROGRAMS = 2 * 132
_MAX_SPLITS = 32
_DECODE_BLOCK_N = 32
_PREFILL_BLOCK_M = 64
_PREFILL_BLOCK_N = 64


@triton.jit(do_not_specialize=["stride_bt", "window"])
def _decode_stage1_kernel(
    q_ptr,
    out_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    token_idx_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    mid_o_ptr,  # (B, num_heads, num_splits, HEAD_DIM) float32, each split's normalized output
    mid_m_ptr,  # (B, num_heads, num_splits) float32, running max (base-2 units)
    mid_l_ptr,  # (B, num_heads, num_splits) float32, sum of exp2(score - max)
    qk_scale,  # scale * log2(e)
    window,  # sliding window (0: full attention)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # positions per page
    BLOCK_N: tl.constexpr,  # positions per tile, a multiple of BLOCK_SIZE
    QUANT: tl.constexpr,
    PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write out[token] instead of the partials
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    num_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    # keys [lo, seq_len); the splits share the pages from lo's on, so split 0's first tile
    # holds lo and every split's first tile a visible key
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    first_page = lo // BLOCK_SIZE
    pages_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_SIZE) - first_page, num_splits)
    start = (first_page + split * pages_per_split) * BLOCK_SIZE
    end = tl.minimum(start + pages_per_split * BLOCK_SIZE, seq_len)

    h = tl.arange(0, BLOCK_H)
    h_mask = h < GROUP
    heads = kv_head * GROUP + h
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    token = tl.load(token_idx_ptr + b).to(tl.int64)
    q_rows = token * stride_qt + heads * stride_qh
    q = tl.load(
        q_ptr + q_rows[:, None] + d[None, :], mask=h_mask[:, None] & d_mask[None, :], other=0
    )  # (BLOCK_H, BLOCK_D)
    block_row_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    sum_exp = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = (pos >= lo) & (pos < end)
        k = _load_kv_tile(
            k_ptr, k_scale_ptr, block_row_ptr, pos, valid, kv_head, d, d_mask,
            stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh,
            q.dtype, BLOCK_SIZE, QUANT,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_H, BLOCK_N)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        sum_exp = sum_exp * alpha + tl.sum(p, 1)
        v = _load_kv_tile(
            v_ptr, v_scale_ptr, block_row_ptr, pos, valid, kv_head, d, d_mask,
            stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh,
            q.dtype, BLOCK_SIZE, QUANT,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    _store_split(
        out_ptr, mid_o_ptr, mid_m_ptr, mid_l_ptr, acc, m, sum_exp, token, b, heads, h_mask, d,
        d_mask, split, num_splits, num_heads, stride_ot, stride_oh, HEAD_DIM, DIRECT,
    )  # fmt: skip


@triton.jit(do_not_specialize=["stride_bt", "window"])
def _prefill_kernel(
    q_ptr,
    out_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    token_start_ptr,
    query_lens_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,  # scale * log2(e)
    window,  # sliding window (0: full attention)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
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
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < query_len
    q_pos = context_len + rows  # (BLOCK_M,) position of each query row
    tokens = tl.load(token_start_ptr + seq).to(tl.int64) + rows
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + (tokens * stride_qt + head * stride_qh)[:, None] + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0,
    )  # (BLOCK_M, BLOCK_D)
    block_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # Causal: the last row of this tile sees keys [0, context_len + (tile + 1) * BLOCK_M).
    end = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_M)
    # Window: row i sees keys from row_lo[i] on; the tile's first row sees the earliest.
    row_lo = tl.where(window > 0, q_pos - window + 1, 0)  # (BLOCK_M,)
    lo = tl.where(window > 0, tl.maximum(context_len + tile * BLOCK_M + 1 - window, 0), 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    sum_exp = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo // BLOCK_N * BLOCK_N, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        k = _load_kv_tile(
            k_ptr, k_scale_ptr, block_row_ptr, pos, valid, kv_head, d, d_mask,
            stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh,
            q.dtype, BLOCK_SIZE, QUANT,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= row_lo[:, None])
        s = tl.where(valid[None, :] & visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # Without a window every row sees position 0, so each row's max is finite after the
        # first tile; a row whose window starts in a later tile has none yet: shift by 0 there
        # (nothing accumulates: exp2(-inf) = 0).
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        sum_exp = sum_exp * alpha + tl.sum(p, 1)
        v = _load_kv_tile(
            v_ptr, v_scale_ptr, block_row_ptr, pos, valid, kv_head, d, d_mask,
            stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh,
            q.dtype, BLOCK_SIZE, QUANT,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    # Rows past query_len (not stored) may see no key under a window: no 0 / 0 for them.
    o = acc / tl.where(sum_exp > 0, sum_exp, 1.0)[:, None]
    tl.store(
        out_ptr + (tokens * stride_ot + head * stride_oh)[:, None] + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def decode_num_splits(batch_size: int, num_kv_heads: int, max_blocks_per_seq: int) -> int:
    """Split-K factor for `paged_decode_attention`, from static sizes only (CUDA-graph safe).

    Enough splits that the B * num_kv_heads * splits stage-1 programs make about two waves on
    132 SMs: cdiv(264, batch_size * num_kv_heads), clamped to [1, min(max_blocks_per_seq, 32)]
    (splits beyond a sequence's pages would read nothing). max_blocks_per_seq is the block table
    width, the most pages any sequence of the batch can have.
    """
    want = triton.cdiv(_TARGET_PROGRAMS, max(batch_size * num_kv_heads, 1))
    return max(1, min(want, max_blocks_per_seq, _MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    cache: KVCache,
    token_idx: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    window: int = 0,
) -> None:
    """Attention of one query token per sequence to its keys [0, seq_len) in the paged cache,
    [seq_len - window, seq_len) under a sliding window (window > 0).

    q, out: (num_tokens, num_heads, head_dim), last dim contiguous, any token/head strides.
    token_idx: (B,) int64, the q/out row of each sequence; only those rows of out are written.
    block_tables: (B, W) int32, row b covering positions [0, seq_lens[b]); later entries unread.
    seq_lens: (B,) int32; seq_len 0 is a padding row: its out row becomes zeros, nothing is read.
    num_splits: split-K factor (see `decode_num_splits`); 1 writes out in one pass.
    The launch depends on (B, num_kv_heads, num_splits) only, never on the values of seq_lens.
    """
    batch = token_idx.shape[0]
    if batch == 0:
        return
    assert num_splits >= 1
    assert block_tables.shape[0] == seq_lens.shape[0] == batch and block_tables.stride(1) == 1
    cache_ptrs, strides, constexprs = _cache_args(cache, q, out)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = cache.k.shape[2]
    group = num_heads // num_kv_heads
    direct, block_s = decode_launch_variant(num_splits)
    if direct:
        mid_o = mid_m = mid_l = out  # never written
    else:
        mid_o, mid_m, mid_l = _split_scratch(batch, num_heads, num_splits, head_dim, q.device)
    _decode_stage1_kernel[(batch, num_kv_heads, num_splits)](
        q,
        out,
        *cache_ptrs,
        token_idx,
        block_tables,
        seq_lens,
        mid_o,
        mid_m,
        mid_l,
        scale * _LOG2E,
        window,
        *strides,
        block_tables.stride(0),
        BLOCK_H=max(triton.next_power_of_2(group), _MIN_DOT),
        BLOCK_N=max(cache.k.shape[1], _DECODE_BLOCK_N),
        DIRECT=direct,
        **constexprs,
        num_warps=4,
    )
    if not direct:
        _launch_decode_stage2(out, token_idx, mid_o, mid_m, mid_l, num_splits, block_s)


def paged_prefill_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    cache: KVCache,
    token_start: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int = 0,
) -> None:
    """Causal attention of chunked prefills: each query attends to keys [0, its position],
    (its position - window, its position] under a sliding window (window > 0).

    q, out: (num_tokens, num_heads, head_dim), last dim contiguous, any token/head strides.
    token_start: (P,) int32, first q/out row of prefill p; its query_lens[p] rows are contiguous.
    query_lens, seq_lens: (P,) int32; the queries sit at positions
    [seq_len - query_len, seq_len), whose keys and values are already in the cache.
    block_tables: (P, W) int32, row p covering positions [0, seq_lens[p]).
    max_query_len: the largest query_lens entry (a host int: it sizes the grid).
    Only the query rows of out are written.
    """
    num_seqs = token_start.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return
    assert query_lens.shape[0] == seq_lens.shape[0] == block_tables.shape[0] == num_seqs
    assert block_tables.stride(1) == 1
    cache_ptrs, strides, constexprs = _cache_args(cache, q, out)
    num_heads = q.shape[1]
    grid = (num_seqs, triton.cdiv(max_query_len, _PREFILL_BLOCK_M), num_heads)
    _prefill_kernel[grid](
        q,
        out,
        *cache_ptrs,
        token_start,
        query_lens,
        seq_lens,
        block_tables,
        scale * _LOG2E,
        window,
        *strides,
        block_tables.stride(0),
        BLOCK_M=_PREFILL_BLOCK_M,
        BLOCK_N=max(cache.k.shape[1], _PREFILL_BLOCK_N),
        **constexprs,
        num_warps=4,
    )
