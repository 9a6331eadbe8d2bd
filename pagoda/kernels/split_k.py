"""Flash-decoding's splits, shared by the decode kernels (attention.py, latent_attention.py): a
split's result stored by stage 1 (`_store_split`: the output itself when there is one split,
else the split's normalized output, max and sum of exponentials), and stage 2, which merges a
row's splits by log-sum-exp in base 2. The launch constexprs that depend on the step are
`decode_launch_variant`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.paged_kv import _block_d


@triton.jit
def _store_split(
    out_ptr,
    mid_o_ptr,
    mid_m_ptr,
    mid_l_ptr,
    acc,  # (BLOCK_H, BLOCK_D) float32, the split's weighted values
    m,  # (BLOCK_H,) its running max (base-2 units)
    sum_exp,  # (BLOCK_H,)
    token,  # the out row (int64)
    b,
    heads,  # (BLOCK_H,) query heads
    h_mask,
    d,
    d_mask,
    split,
    num_splits,
    num_heads,
    stride_ot,
    stride_oh,
    WIDTH: tl.constexpr,  # values per head in the partials
    DIRECT: tl.constexpr,
):
    """A decode split's result: out[token] itself when it is the only split (DIRECT), else its
    normalized output, max and sum into the partials stage 2 merges. A split without pages (or
    a padding row, seq_len 0) has sum_exp == 0: output 0, max -inf."""
    o = acc / tl.where(sum_exp > 0, sum_exp, 1.0)[:, None]
    if DIRECT:
        o_rows = token * stride_ot + heads * stride_oh
        tl.store(
            out_ptr + o_rows[:, None] + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=h_mask[:, None] & d_mask[None, :],
        )
    else:
        ml_rows = (b.to(tl.int64) * num_heads + heads) * num_splits + split  # (BLOCK_H,)
        tl.store(
            mid_o_ptr + ml_rows[:, None] * WIDTH + d[None, :],
            o,
            mask=h_mask[:, None] & d_mask[None, :],
        )
        tl.store(mid_m_ptr + ml_rows, m, mask=h_mask)
        tl.store(mid_l_ptr + ml_rows, sum_exp, mask=h_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_stage2_kernel(
    out_ptr,
    token_idx_ptr,
    mid_o_ptr,
    mid_m_ptr,
    mid_l_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of two
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    rows = (b.to(tl.int64) * num_heads + head) * num_splits + s  # (BLOCK_S,)
    m = tl.load(mid_m_ptr + rows, mask=s_mask, other=float("-inf"))
    sum_exp = tl.load(mid_l_ptr + rows, mask=s_mask, other=0.0)
    o = tl.load(
        mid_o_ptr + rows[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_S, BLOCK_D)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, sum_exp * tl.exp2(m - m_max))
    total = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    token = tl.load(token_idx_ptr + b).to(tl.int64)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + d,
        res.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def decode_launch_variant(num_splits: int) -> tuple[bool, int]:
    """The constexprs of a decode launch that depend on the step, (DIRECT, BLOCK_S): launches
    with equal variants (and equal model and cache) run the same compiled kernels."""
    return num_splits == 1, triton.next_power_of_2(num_splits)


def _split_scratch(
    batch: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float32 split-K partials of a decode launch: mid_o (batch, num_heads, num_splits,
    head_dim), the running max mid_m and sum mid_l (batch, num_heads, num_splits)."""
    mid_o = torch.empty(
        (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=device
    )
    mid_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device)
    mid_l = torch.empty_like(mid_m)
    return mid_o, mid_m, mid_l


def _launch_decode_stage2(
    out: torch.Tensor,
    token_idx: torch.Tensor,
    mid_o: torch.Tensor,
    mid_m: torch.Tensor,
    mid_l: torch.Tensor,
    num_splits: int,
    block_s: int,
) -> None:
    """Merge the split-K partials of each (sequence, head) into its out row."""
    batch, num_heads, _, head_dim = mid_o.shape
    _decode_stage2_kernel[(batch, num_heads)](
        out,
        token_idx,
        mid_o,
        mid_m,
        mid_l,
        num_splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_S=block_s,
        num_warps=1,
    )
