"""Triton batched LoRA for CUDA: many adapters' products in one step. Reference:
`lora_reference` in pagoda/layers/lora.py (its docstring has the shapes); tests:
tests/unit/test_triton_lora.py (interpreter) and tests/gpu/test_lora_gpu.py.

Two kernels, the shrink / expand split of Punica's batched GEMMs:

    shrink  H[p, t, l, :] = A[s, l] @ x[t] over split p's share of K    (float32)
    expand  y[t, o0:o1] += B[s, o0:o1] @ sum_p H[p, t, l, :]            for each slice l

with s = slots[t]; a token with slot -1 gets nothing (its H rows are never written nor read).

Grouping by adapter without a host sync: every program takes a block of BLOCK_M consecutive
tokens and loops on the device over the distinct slots among them, in increasing order (the
next slot is the least one above the current, until none is left); for slot s it multiplies
the block's rows with slots[t] == s (the others masked to zero) by adapter s's weights. Tokens
come in runs of one slot, so a block mostly holds one slot and reads its adapter once; a block
of mixed slots reads each of its adapters once and is still exact per row. Grids come from
shapes only (T, L, K, the slices' widths), so a step can be captured in a CUDA graph; slots are
read on the device.

Splits: with few programs over tokens and slices (decode), the shrink splits K into up to
MAX_SPLITS chunks of whole BLOCK_K tiles, each writing its own partial H (no atomics: the sum
is deterministic), and the expand adds the partials in split order when it loads H. Trailing
splits past K store zeros.

Precision: the shrink's products of x and A are exact in float32 (ieee for float32 inputs) and
accumulate in float32. H stays float32, as the reference's, and the expand multiplies it by B
widened to float32 with tf32x3 (three TF32 tensor-core products: H's hi and lo parts by B's,
B's lo part zero for bf16 / fp16; about 2^-21 relative error per product, float32's order,
where an ieee dot would run on the CUDA cores). The expand's sum is rounded to y's dtype, then
added to y and rounded again, as the reference's `y += delta.to(y.dtype)`. R is padded to a
power of two, at least 16 (tl.dot's minimum side), with masks.

Tiles: BLOCK_M = 16 for T <= SMALL_T tokens, else 64; shrink BLOCK_K = 128, expand
BLOCK_N = 64, 4 warps; with BLOCK_M * BLOCK_R >= 64 * 64, 8 warps and expand BLOCK_N = 32;
float32 inputs: shrink BLOCK_K = 2048 / BLOCK_R, 8 warps. Chosen so that no variant spills
registers when compiled for sm_90 (ptxas -v, as tests/unit/test_triton_compile.py compiles),
without a GPU at hand: untuned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SMALL_T = 128  # more tokens: BLOCK_M = 64
MAX_SPLITS = 8
_TARGET_PROGRAMS = 64  # shrink programs (token blocks x slices x splits) wanted before splitting
_BLOCK_K = 128
_BLOCK_N = 64
_MIN_DOT = 16  # tl.dot needs every side >= 16 on the GPU
_NUM_WARPS_LARGE = 8
_FLOAT32_TILE = 2048  # BLOCK_K * BLOCK_R of a float32 shrink


@triton.jit(do_not_specialize=["T", "stride_hp"])
def _shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    h_ptr,
    T,
    K,
    R,
    S,  # slots in a: every slots[t] is -1 or below S
    k_chunk,  # K columns per split, a multiple of BLOCK_K
    stride_xm,
    stride_as,
    stride_al,
    stride_ar,
    stride_hp,
    stride_hm,
    stride_hl,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    sl = tl.program_id(1)
    split = tl.program_id(2)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    slot_rows = tl.load(slots_ptr + rows, mask=rows < T, other=-1)
    ranks = tl.arange(0, BLOCK_R)
    r_mask = ranks < R
    k_start = split * k_chunk
    k_end = tl.minimum(K, k_start + k_chunk)
    x_rows = x_ptr + rows[:, None] * stride_xm
    h_ptrs = h_ptr + split.to(tl.int64) * stride_hp + rows[:, None] * stride_hm + sl * stride_hl
    slot = tl.min(tl.where(slot_rows >= 0, slot_rows, S))
    while slot < S:
        sel = slot_rows == slot
        a_rows = a_ptr + slot * stride_as + sl * stride_al + ranks[:, None] * stride_ar
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            k_mask = cols < k_end
            x = tl.load(x_rows + cols[None, :], mask=sel[:, None] & k_mask[None, :], other=0.0)
            a = tl.load(a_rows + cols[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            # (BLOCK_M, BLOCK_K) @ (BLOCK_K, BLOCK_R)
            acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
        tl.store(h_ptrs + ranks[None, :], acc, mask=sel[:, None] & r_mask[None, :])
        slot = tl.min(tl.where(slot_rows > slot, slot_rows, S))


@triton.jit(do_not_specialize=["T", "stride_hp"])
def _expand_kernel(
    h_ptr,  # H[:, :, l]: this slice's ranks
    b_ptr,  # B[:, o0:o1]: this slice's output rows
    slots_ptr,
    y_ptr,  # y[:, o0:o1]
    T,
    N,  # the slice's width o1 - o0
    R,
    S,
    num_splits,
    stride_hp,
    stride_hm,
    stride_bs,
    stride_bn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    slot_rows = tl.load(slots_ptr + rows, mask=rows < T, other=-1)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = cols < N
    ranks = tl.arange(0, BLOCK_R)
    r_mask = ranks < R
    h_rows = h_ptr + rows[:, None] * stride_hm + ranks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    slot = tl.min(tl.where(slot_rows >= 0, slot_rows, S))
    while slot < S:
        h_mask = (slot_rows == slot)[:, None] & r_mask[None, :]
        h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for split in range(num_splits):
            h += tl.load(h_rows + split * stride_hp, mask=h_mask, other=0.0)
        b_ptrs = b_ptr + slot * stride_bs + cols[:, None] * stride_bn + ranks[None, :]
        b = tl.load(b_ptrs, mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        # (BLOCK_M, BLOCK_R) @ (BLOCK_R, BLOCK_N), rows of other slots zero
        acc = tl.dot(h, tl.trans(b.to(tl.float32)), acc, input_precision="tf32x3")
        slot = tl.min(tl.where(slot_rows > slot, slot_rows, S))
    dtype = y_ptr.dtype.element_ty
    out_mask = (slot_rows >= 0)[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    y = tl.load(y_ptrs, mask=out_mask, other=0.0)
    y = (y.to(tl.float32) + acc.to(dtype).to(tl.float32)).to(dtype)
    tl.store(y_ptrs, y, mask=out_mask)


def _block_m(num_tokens: int) -> int:
    return _MIN_DOT if num_tokens <= SMALL_T else 64


def num_splits(num_tokens: int, num_slices: int, k: int) -> int:
    """The shrink's K splits for a shape (module docstring): enough programs to fill
    _TARGET_PROGRAMS, at most MAX_SPLITS and one BLOCK_K tile each."""
    programs = triton.cdiv(num_tokens, _block_m(num_tokens)) * num_slices
    return max(1, min(MAX_SPLITS, triton.cdiv(k, _BLOCK_K), _TARGET_PROGRAMS // programs))


def _shrink_config(dtype: torch.dtype, block_m: int, block_r: int) -> tuple[int, int]:
    """(BLOCK_K, num_warps) of the shrink (module docstring)."""
    if dtype == torch.float32:  # ieee: the dot's tiles in registers, BLOCK_K * BLOCK_R = 2048
        return _FLOAT32_TILE // block_r, _NUM_WARPS_LARGE
    return _BLOCK_K, _NUM_WARPS_LARGE if block_m * block_r >= 64 * 64 else 4


def _check(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    offsets: list[int],
) -> None:
    t, k = x.shape
    num_slots, num_slices, rank = a.shape[:3]
    assert y.is_contiguous() and y.shape == (t, offsets[-1]), "y: (T, N) contiguous"
    assert x.stride(1) == 1 and a.stride(3) == 1 and b.stride(2) == 1
    assert a.shape[3] == k and b.shape == (num_slots, offsets[-1], rank)
    assert a.dtype == b.dtype == x.dtype and a.device == b.device == x.device == y.device
    assert len(offsets) == num_slices + 1 and offsets[0] == 0
    assert slots.shape == (t,) and slots.is_contiguous() and slots.device == x.device
    assert not slots.dtype.is_floating_point


def lora_apply_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    offsets: list[int],
) -> None:
    """In place on y: `lora_reference` (pagoda/layers/lora.py). x (T, K), last dim contiguous;
    y (T, N) contiguous; a (S, L, R, K), b (S, N, R), last dims contiguous, x's dtype; slots
    (T,) integers, -1 or below S; offsets: the L slices' first output columns, then N."""
    _check(y, x, a, b, slots, offsets)
    t, k = x.shape
    num_slots, num_slices, rank = a.shape[:3]
    if t == 0 or num_slots == 0 or rank == 0:
        return
    block_m = _block_m(t)
    block_r = max(_MIN_DOT, triton.next_power_of_2(rank))
    splits = num_splits(t, num_slices, k)
    k_chunk = triton.cdiv(triton.cdiv(k, splits), _BLOCK_K) * _BLOCK_K
    block_k, num_warps = _shrink_config(x.dtype, block_m, block_r)
    h = torch.empty((splits, t, num_slices, rank), dtype=torch.float32, device=x.device)
    # (token blocks, slices, K splits)
    _shrink_kernel[(triton.cdiv(t, block_m), num_slices, splits)](
        x,
        a,
        slots,
        h,
        t,
        k,
        rank,
        num_slots,
        k_chunk,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        a.stride(2),
        h.stride(0),
        h.stride(1),
        h.stride(2),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
    for sl, (o0, o1) in enumerate(zip(offsets[:-1], offsets[1:])):
        if o1 > o0:
            _expand(y[:, o0:o1], h[:, :, sl], b[:, o0:o1], slots, block_m, block_r)


def _expand(
    y: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    block_m: int,
    block_r: int,
) -> None:
    """y += B @ H for one slice: y (T, W) and b (S, W, R) that slice's views, h (splits, T, R)."""
    t, width = y.shape
    num_slots, _, rank = b.shape
    block_n = _BLOCK_N if block_m * block_r < 64 * 64 else _BLOCK_N // 2
    # (token blocks, column tiles of the slice)
    _expand_kernel[(triton.cdiv(t, block_m), triton.cdiv(width, block_n))](
        h,
        b,
        slots,
        y,
        t,
        width,
        rank,
        num_slots,
        h.shape[0],
        h.stride(0),
        h.stride(1),
        b.stride(0),
        b.stride(1),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        num_warps=_NUM_WARPS_LARGE if block_m * block_r >= 64 * 64 else 4,
    )
