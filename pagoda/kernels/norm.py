"""Triton RMSNorm, alone and with the residual add fused in. Reference: `RMSNorm.forward` in
pagoda/layers/norm.py; tests: tests/unit/test_triton_kernels.py.

One program per row, the whole row in one block (hidden sizes up to a few thousand). Rounding
follows the reference step by step so results agree to the last bit or two:
    hidden = x + residual               rounded to the dtype
    normed = h32 * rsqrt(mean(h32^2) + eps)   in float32, rounded to the dtype
    out    = weight * normed            float product rounded once to the dtype
Only the float32 reduction order and rsqrt differ from torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,  # unused unless ADD
    weight_ptr,
    out_ptr,
    hidden_ptr,  # unused unless ADD
    hidden_size,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_h,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    dtype = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(hidden_ptr + row * stride_h + cols, h, mask=mask)
    h32 = h.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h32 * h32, axis=0) / hidden_size + eps)
    normed = (h32 * rstd).to(dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # x, residual: (num_tokens, hidden_size), rows strided, last dim contiguous
    num_tokens, hidden_size = x.shape
    assert x.stride(-1) == 1 and weight.shape == (hidden_size,) and weight.is_contiguous()
    assert weight.dtype == x.dtype
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
    hidden = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(-1) == 1
        hidden = torch.empty_like(out)
    if num_tokens == 0:
        return out, hidden
    block = triton.next_power_of_2(hidden_size)
    # (num_tokens,): one program per row
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        hidden if hidden is not None else out,
        hidden_size,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        hidden.stride(0) if hidden is not None else 0,
        BLOCK=block,
        ADD=residual is not None,
        num_warps=max(1, min(8, block // 256)),
    )
    return out, hidden


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalize(x) as `RMSNorm(x)` computes it.

    x: (num_tokens, hidden_size), any row stride, last dim contiguous; weight: (hidden_size,) in
    x's dtype -> out: (num_tokens, hidden_size) contiguous, x's dtype.
    """
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(hidden), hidden) with hidden = x + residual, as `RMSNorm(x, residual)` computes it.

    x, residual: (num_tokens, hidden_size), any row strides, last dims contiguous, same dtype;
    weight: (hidden_size,) -> out, hidden: (num_tokens, hidden_size) contiguous, new tensors.
    """
    out, hidden = _launch(x, residual, weight, eps)
    assert hidden is not None
    return out, hidden
