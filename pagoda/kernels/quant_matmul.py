"""Triton weight-only quantized GEMMs for CUDA: w4a16 and w8a16. References: `int4_dequantize`
and the int8 forms in pagoda/layers/quant_forms.py, then a float matmul; tests:
tests/unit/test_triton_quant_matmul.py (interpreter) and tests/gpu/test_quant_gpu.py.

Stored forms (N output rows, K input columns, G = K // group_size groups per row):

    w4a16  qweight (N, K // 2) uint8, two 4-bit codes per byte along K:
               byte j of a row = code[2j] | code[2j + 1] << 4   (low nibble: the even column)
           scale, zero (N, G):  w[n, k] = (code[n, k] - 8) * scale[n, k // g] + zero[n, k // g]
    w8a16  qweight (N, K) int8; scale (N, G):  w[n, k] = code[n, k] * scale[n, k // g]
           per row (group_size == K, scale (N, 1)): the row scale multiplies the accumulator
           after the K loop instead of each weight (the same product, one rounding fewer)

scale and zero may be any float dtype (pagoda stores them in the model's dtype); the dequantization
runs in float32 exactly as the reference, its result is rounded to x's dtype and fed to tl.dot,
which accumulates in float32 (float32 x: ieee products, no tf32). y comes back in x's dtype.

Two forms of the matmul, chosen by the number of rows of x (a host shape, so no sync):

    M <= GEMM_MAX_M (64)  one fused kernel: programs over (N tiles, M tiles); each walks K in
                          tiles of BLOCK_K, dequantizing its (BLOCK_N, BLOCK_K) weight tile in
                          registers (decode: the weight is read once, in its quantized bytes)
    M >  GEMM_MAX_M       dequantize-then-GEMM: a Triton kernel writes the weight in x's dtype
                          to a temporary, at most DEQUANT_CHUNK elements at a time (row chunks),
                          and cuBLAS (F.linear) multiplies (prefill: compute-bound)

Tiles: BLOCK_M = M rounded up to a power of two, at least 16 (tl.dot's minimum); BLOCK_N = 64;
BLOCK_K = 128; 4 warps, Triton's default pipelining. Chosen without a GPU at hand: untuned.

Group tiling: a tile of BLOCK_K columns holds BLOCK_K // GROUP_K runs of GROUP_K columns that
share a scale. A power-of-two group_size <= 128 gives BLOCK_K = 128 and GROUP_K = group_size
(whole groups per tile); other group sizes give GROUP_K = BLOCK_K = the largest power of two
dividing group_size, at most 128 (tiles inside one group). group_size must divide K and be a
multiple of 16 (tl.dot's minimum side), except per row. K need not be a multiple of BLOCK_K
(masked tail), nor N of BLOCK_N.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

GEMM_MAX_M = 64  # larger M: dequantize-then-GEMM
DEQUANT_CHUNK = 1 << 24  # most weight elements dequantized into one temporary (32 MiB in bf16)
_BLOCK_N = 64
_BLOCK_K = 128
_MIN_DOT = 16  # tl.dot needs every side >= 16 on the GPU


@triton.jit
def _weight_tile(
    qw_ptr,
    scale_ptr,
    zero_ptr,  # unused unless HAS_ZERO
    rows,  # (BLOCK_N,) int64 weight rows
    row_mask,
    k0,  # first column of the tile, a multiple of BLOCK_K
    K,
    num_groups,
    group_size,
    stride_qn,
    stride_sn,
    stride_zn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    SCALED: tl.constexpr,
):
    """(BLOCK_N, BLOCK_K) float32 weights of columns [k0, k0 + BLOCK_K); codes only (no scale)
    unless SCALED. Columns past K and rows past N hold finite junk: their x columns / y rows are
    masked by the caller."""
    if BITS == 4:
        cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = row_mask[:, None] & (cols < K // 2)[None, :]
        packed = tl.load(qw_ptr + rows[:, None] * stride_qn + cols[None, :], mask=mask, other=0)
        # (BLOCK_N, BLOCK_K // 2, 2) -> (BLOCK_N, BLOCK_K): column 2j is the low nibble of byte j
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))
        w = codes.to(tl.float32) - 8.0
    else:
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (cols < K)[None, :]
        codes = tl.load(qw_ptr + rows[:, None] * stride_qn + cols[None, :], mask=mask, other=0)
        w = codes.to(tl.float32)
    if SCALED:
        GROUPS: tl.constexpr = BLOCK_K // GROUP_K
        groups = k0 // group_size + tl.arange(0, GROUPS)
        g_mask = row_mask[:, None] & (groups < num_groups)[None, :]
        s = tl.load(scale_ptr + rows[:, None] * stride_sn + groups[None, :], mask=g_mask, other=0.0)
        w3 = tl.reshape(w, (BLOCK_N, GROUPS, GROUP_K)) * s.to(tl.float32)[:, :, None]
        if HAS_ZERO:
            zp = zero_ptr + rows[:, None] * stride_zn + groups[None, :]
            z = tl.load(zp, mask=g_mask, other=0.0)
            w3 = w3 + z.to(tl.float32)[:, :, None]
        w = tl.reshape(w3, (BLOCK_N, BLOCK_K))
    return w


@triton.jit(do_not_specialize=["M"])
def _quant_matmul_kernel(
    x_ptr,
    qw_ptr,
    scale_ptr,
    zero_ptr,  # unused unless HAS_ZERO
    y_ptr,
    M,
    N,
    K,
    num_groups,
    group_size,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    ROW_SCALE: tl.constexpr,  # one scale per row, applied to the accumulator
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask = rows_m < M
    n_mask = rows_n < N
    x_rows = x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & (cols < K)[None, :], other=0.0)
        w = _weight_tile(
            qw_ptr,
            scale_ptr,
            zero_ptr,
            rows_n,
            n_mask,
            k0,
            K,
            num_groups,
            group_size,
            stride_qn,
            stride_sn,
            stride_zn,
            BLOCK_N,
            BLOCK_K,
            GROUP_K,
            BITS,
            HAS_ZERO,
            not ROW_SCALE,
        )
        # (BLOCK_M, BLOCK_K) @ (BLOCK_K, BLOCK_N)
        acc = tl.dot(x, tl.trans(w.to(dtype)), acc, input_precision=PRECISION)
    if ROW_SCALE:
        s = tl.load(scale_ptr + rows_n * stride_sn, mask=n_mask, other=0.0)
        acc = acc * s.to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows_m.to(tl.int64)[:, None] * stride_ym + rows_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequantize_kernel(
    qw_ptr,
    scale_ptr,
    zero_ptr,  # unused unless HAS_ZERO
    w_ptr,
    N,
    K,
    num_groups,
    group_size,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
):
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = rows < N
    w = _weight_tile(
        qw_ptr,
        scale_ptr,
        zero_ptr,
        rows,
        n_mask,
        k0,
        K,
        num_groups,
        group_size,
        stride_qn,
        stride_sn,
        stride_zn,
        BLOCK_N,
        BLOCK_K,
        GROUP_K,
        BITS,
        HAS_ZERO,
        True,
    )
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = n_mask[:, None] & (cols < K)[None, :]
    tl.store(
        w_ptr + rows[:, None] * stride_wn + cols[None, :], w.to(w_ptr.dtype.element_ty), mask=mask
    )


# ---------------------------------------------------------------------------------------------
# Host side


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes (N, K) in [0, 15], K even -> (N, K // 2) uint8, byte j = code[2j] | code[2j+1] << 4."""
    assert codes.shape[-1] % 2 == 0
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: (N, K // 2) uint8 -> codes (N, K) uint8."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def _k_tiles(group_size: int, k: int) -> tuple[int, int]:
    """(BLOCK_K, GROUP_K) for a group size (see the top of this file)."""
    assert group_size > 0 and k % group_size == 0, f"group {group_size} does not divide K={k}"
    if group_size == k:  # one group per row: any tile lies inside it
        return _BLOCK_K, _BLOCK_K
    low = group_size & -group_size  # the largest power of two dividing group_size
    assert low >= _MIN_DOT, f"group_size {group_size} must be a multiple of {_MIN_DOT}"
    if low == group_size and group_size <= _BLOCK_K:
        return _BLOCK_K, group_size
    return min(low, _BLOCK_K), min(low, _BLOCK_K)


def _block_m(m: int) -> int:
    return max(_MIN_DOT, triton.next_power_of_2(m))


def launch_variant(m: int) -> int:
    """The one constexpr of a matmul over m rows of x that depends on the step: the fused
    kernel's BLOCK_M, or 0 for dequantize-then-GEMM (M is not specialized: the kernels compiled
    for one m serve every m of its variant)."""
    return 0 if m > GEMM_MAX_M else _block_m(m)


def _check(
    qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, k: int, group_size: int
) -> None:
    n = qweight.shape[0]
    assert qweight.stride(-1) == 1, "qweight rows must be contiguous"
    for t in (scale, zero):
        if t is not None:
            assert t.shape == (n, k // group_size), f"{tuple(t.shape)} != {(n, k // group_size)}"
            assert t.shape[1] == 1 or t.stride(1) == 1
            assert t.is_floating_point()


def _dequantize_then_gemm(
    x2: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """x2 (M, K) @ w.T -> (M, N), w dequantized in row chunks of at most DEQUANT_CHUNK elements,
    each multiplied by the library GEMM."""
    k, n = x2.shape[1], qweight.shape[0]
    chunk = max(1, DEQUANT_CHUNK // k)
    parts = []
    for n0 in range(0, n, chunk):
        rows = slice(n0, n0 + chunk)
        zero_rows = None if zero is None else zero[rows]
        w = _dequantize(qweight[rows], scale[rows], zero_rows, k, group_size, bits, x2.dtype)
        parts.append(F.linear(x2, w))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _run(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    # x: (..., K) -> (..., N) in x's dtype
    lead, k = x.shape[:-1], x.shape[-1]
    n = qweight.shape[0]
    _check(qweight, scale, zero, k, group_size)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0 or n == 0:
        return x.new_zeros((*lead, n))
    if m > GEMM_MAX_M:
        return _dequantize_then_gemm(x2, qweight, scale, zero, group_size, bits).reshape(*lead, n)
    block_k, group_k = _k_tiles(group_size, k)
    block_m = _block_m(m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    zero_arg = scale if zero is None else zero
    # (N tiles, M tiles): one program per output tile, each over all of K
    grid = (triton.cdiv(n, _BLOCK_N), triton.cdiv(m, block_m))
    _quant_matmul_kernel[grid](
        x2,
        qweight,
        scale,
        zero_arg,
        y,
        m,
        n,
        k,
        k // group_size,
        group_size,
        x2.stride(0),
        qweight.stride(0),
        scale.stride(0),
        zero_arg.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=block_k,
        GROUP_K=group_k,
        BITS=bits,
        HAS_ZERO=zero is not None,
        ROW_SCALE=group_size == k and zero is None,
        # float32: true float32 products (no tf32); ignored for 16-bit inputs.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return y.reshape(*lead, n)


def _dequantize(
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    k: int,
    group_size: int,
    bits: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    n = qweight.shape[0]
    _check(qweight, scale, zero, k, group_size)
    w = torch.empty((n, k), dtype=dtype, device=qweight.device)
    if n == 0 or k == 0:
        return w
    block_k, group_k = _k_tiles(group_size, k)
    zero_arg = scale if zero is None else zero
    # (N tiles, K tiles): one program per weight tile
    _dequantize_kernel[(triton.cdiv(n, _BLOCK_N), triton.cdiv(k, block_k))](
        qweight,
        scale,
        zero_arg,
        w,
        n,
        k,
        k // group_size,
        group_size,
        qweight.stride(0),
        scale.stride(0),
        zero_arg.stride(0),
        w.stride(0),
        BLOCK_N=_BLOCK_N,
        BLOCK_K=block_k,
        GROUP_K=group_k,
        BITS=bits,
        HAS_ZERO=zero is not None,
        num_warps=4,
    )
    return w


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """x @ w.T with w[n, k] = (code[n, k] - 8) * scale[n, k // g] + zero[n, k // g].

    x: (..., K) float32 / bfloat16 / float16, last dim contiguous (else copied);
    qweight: (N, K // 2) uint8 from `pack_int4`; scale, zero: (N, K // group_size), any float
    dtype -> (..., N) in x's dtype.
    """
    assert qweight.dtype == torch.uint8 and qweight.shape[1] * 2 == x.shape[-1]
    return _run(x, qweight, scale, zero, group_size, 4)


def w8a16_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x @ w.T with w[n, k] = code[n, k] * scale[n, k // g]; group_size == K: one scale per row.

    x: (..., K) float32 / bfloat16 / float16, last dim contiguous (else copied);
    qweight: (N, K) int8; scale: (N, K // group_size), any float dtype -> (..., N) in x's dtype.
    """
    assert qweight.dtype == torch.int8 and qweight.shape[1] == x.shape[-1]
    return _run(x, qweight, scale, None, group_size, 8)


def w4a16_dequantize(
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The w of `w4a16_matmul` as an (N, K) tensor of `dtype` (float32 math, rounded once)."""
    return _dequantize(qweight, scale, zero, 2 * qweight.shape[1], group_size, 4, dtype)


def w8a16_dequantize(
    qweight: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The w of `w8a16_matmul` as an (N, K) tensor of `dtype` (float32 math, rounded once)."""
    return _dequantize(qweight, scale, None, qweight.shape[1], group_size, 8, dtype)
