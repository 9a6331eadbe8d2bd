"""Triton gated activation silu(gate) * up over a fused gate_up projection. Reference:
`SiluAndMul` in pagoda/layers/activation.py; tests: tests/unit/test_triton_kernels.py.

Computed in float32 and rounded once to the dtype; the reference rounds silu(gate) to the dtype
before the multiply, so bf16 / fp16 results may differ from it by about one ulp of the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    d,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = gate | up.

    x: (num_tokens, 2 * d), any row stride, last dim contiguous -> (num_tokens, d) contiguous,
    x's dtype.
    """
    num_tokens, two_d = x.shape
    assert two_d % 2 == 0 and x.stride(-1) == 1
    d = two_d // 2
    out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(_MAX_BLOCK, triton.next_power_of_2(d))
    # (num_tokens, cdiv(d, BLOCK)): one program per row and column tile
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
        x,
        out,
        d,
        x.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=max(1, min(8, block // 256)),
    )
    return out
