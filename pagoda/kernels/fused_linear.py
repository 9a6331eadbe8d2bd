"""Triton linear layers for a few rows, with their neighbours in the decoder layer fused in.
References: `RMSNorm`, `F.linear`, `SiluAndMul` and the residual add of pagoda/layers, composed
as `LlamaDecoderLayer.forward`; tests: tests/unit/test_triton_fused_linear.py.

A decode layer of the triton backend then launches 7 kernels instead of 10:

    norm_qkv   qkv = linear(rms_norm(h))                  RMSNorm in the prologue
               rotary + KV write, attention (2)
    o_add      h = linear(attn) + h                       residual add in the epilogue
    norm_gate  act = silu_and_mul(linear(rms_norm(h)))    both fused
    down_add   h = linear(act) + h

so the layer carries one residual stream `h` instead of vLLM's (hidden, residual) pair.

    y = prologue(x) @ W^T (+ bias), epilogue:
    NORM      x -> weight * rms_norm(x), rounded as `RMSNorm`: normed = (x32 * rstd) rounded to
              the dtype, then the weight product rounded once; rstd from a first pass over x
    ADD       out = y + residual: y rounded to the dtype first, then the sum rounded, as the
              reference's separate add
    SILU_MUL  W = gate | up (2N rows): out = silu(gate) * up in float32, rounded once, from gate
              and up each rounded to the dtype (as the unfused linear output)

Rows: M <= MAX_ROWS (16) in one BLOCK_M = 16 tile (tl.dot's minimum side), so each program
reads its weight rows once; programs over BLOCK_N output columns. M is not specialized: one
compiled variant per (flags, dtype) serves every batch of 1..16 rows. Larger M goes through the
unfused path (cuBLAS). Tiles BLOCK_N = 32, BLOCK_K = 128, 4 warps: chosen without a GPU, untuned.
Products are exact in float32 (ieee, no tf32); accumulation in float32 in K-tile order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # more rows: the unfused layer (cuBLAS GEMMs, then the norm / activation kernels)
_BLOCK_M = 16
_BLOCK_N = 32
_BLOCK_K = 128

_NONE, _ADD, _SILU_MUL = 0, 1, 2


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_rm", "stride_ym"])
def _fused_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,  # unused unless HAS_BIAS
    norm_ptr,  # unused unless NORM
    res_ptr,  # unused unless EPILOGUE == ADD
    y_ptr,
    M,
    N,  # output columns (SILU_MUL: W has 2N rows, gate then up)
    K,
    eps,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,  # 0 none, 1 residual add, 2 silu(gate) * up
    PRECISION: tl.constexpr,
):
    dtype = x_ptr.dtype.element_ty
    rows_m = tl.arange(0, BLOCK_M)
    m_mask = rows_m < M
    x_rows = x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm
    cols_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = cols_n < N
    w_rows = w_ptr + cols_n[:, None] * stride_wn
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = m_mask[:, None] & (cols < K)[None, :]
            x32 = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sum_sq += tl.sum(x32 * x32, axis=1)
        rstd = tl.math.rsqrt(sum_sq / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_mask = cols < K
        x = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM:
            normed = (x.to(tl.float32) * rstd[:, None]).to(dtype)
            g = tl.load(norm_ptr + cols, mask=k_mask, other=0.0)
            x = (g.to(tl.float32)[None, :] * normed.to(tl.float32)).to(dtype)
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + cols[None, :], mask=w_mask, other=0.0)
        # (BLOCK_M, BLOCK_K) @ (BLOCK_K, BLOCK_N)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if EPILOGUE == 2:
            w_up = tl.load(w_rows + N * stride_wn + cols[None, :], mask=w_mask, other=0.0)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if EPILOGUE == 2:
            b_up = tl.load(bias_ptr + N + cols_n, mask=n_mask, other=0.0)
            acc_up += b_up.to(tl.float32)[None, :]
    y = acc.to(dtype)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if EPILOGUE == 1:
        r = tl.load(res_ptr + rows_m.to(tl.int64)[:, None] * stride_rm + cols_n[None, :], out_mask)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
    if EPILOGUE == 2:
        gate = y.to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
    y_ptrs = y_ptr + rows_m.to(tl.int64)[:, None] * stride_ym + cols_n[None, :]
    tl.store(y_ptrs, y, mask=out_mask)


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """prologue(x) @ weight^T (+ bias), epilogue, for at most MAX_ROWS rows (module docstring).

    x: (M, K), any row stride, last dim contiguous; weight: (N, K) contiguous, or (2N, K) gate |
    up with silu_mul; bias: (N,) or (2N,); norm: (RMSNorm weight (K,), eps) applied to x first;
    residual: (M, N), last dim contiguous, added to the output. All in x's dtype.
    -> (M, N) contiguous, x's dtype. residual and silu_mul exclude each other.
    """
    m, k = x.shape
    assert m <= MAX_ROWS, f"fused_linear takes at most {MAX_ROWS} rows, got {m}"
    assert x.stride(-1) == 1 and weight.is_contiguous() and weight.shape[1] == k
    assert weight.dtype == x.dtype and not (silu_mul and residual is not None)
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if bias is not None:
        assert bias.shape == (weight.shape[0],) and bias.is_contiguous()
    if norm is not None:
        assert norm[0].shape == (k,) and norm[0].dtype == x.dtype and norm[0].is_contiguous()
    if residual is not None:
        assert residual.shape == (m, n) and residual.stride(-1) == 1
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    epilogue = _SILU_MUL if silu_mul else _ADD if residual is not None else _NONE
    # (cdiv(N, BLOCK_N),): every program takes all M rows of its output columns
    _fused_linear_kernel[(triton.cdiv(n, _BLOCK_N),)](
        x,
        weight,
        bias if bias is not None else weight,
        norm[0] if norm is not None else weight,
        residual if residual is not None else y,
        y,
        m,
        n,
        k,
        norm[1] if norm is not None else 0.0,
        x.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        y.stride(0),
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
        NORM=norm is not None,
        HAS_BIAS=bias is not None,
        EPILOGUE=epilogue,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return y
