"""RMSNorm, with the residual add of the next sub-block fused in.

Contract (as vLLM's): `norm(x)` returns the normalized x; `norm(x, residual)` first forms
`h = x + residual` and returns `(norm(h), h)`, so a decoder layer carries the running residual
stream without a separate add. Statistics are computed in float32 and cast back before the
weight multiply, as HF transformers does, so fp32 results match HF bit for bit. Backend
`triton` runs the fused kernel of pagoda/kernels/norm.py (same contract, tested against this);
on CPU with pagoda's C++ kernels, float32 rows and a half model's bfloat16 / float16 rows run
pagoda_cpu's (kernels/cpu/row_ops.cpp, rounding half rows where these torch ops do), the same
function in eager and compiled steps.
"""

from __future__ import annotations

import torch
from torch import nn

# The dtypes pagoda_cpu's row ops take (norms, SiLU-and-mul, rotary), their other tensors in the
# rows' dtype
CPU_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RMSNorm(nn.Module):
    backend = "torch"  # or "triton", set by the model runner
    # torch backend on CPU with pagoda's C++ kernels built (set likewise): rows of
    # CPU_ROW_DTYPES with a weight of their dtype run pagoda_cpu.rms_norm / add_rms_norm,
    # which compiled decode steps call too
    cpu_kernel = False
    # Gemma's norms scale by (1 + w): 1.0 there. The parameter holds the factor itself
    # (checkpoint value + offset, `from_checkpoint`), so every backend runs the same norm.
    weight_offset = 0.0

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def from_checkpoint(self, weight: torch.Tensor) -> torch.Tensor:
        """The parameter's value for checkpoint tensor `weight` (HF's value)."""
        return weight + self.weight_offset if self.weight_offset else weight

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., hidden_size)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.backend == "triton":
            return self._forward_triton(x, residual)
        if self.cpu_kernel and _cpu_rows(x, self.weight, residual):
            return self._forward_cpu(x, residual)
        if residual is None:
            return self._norm(x)
        hidden = x + residual
        return self._norm(hidden), hidden

    def _forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = torch.ops.pagoda_cpu
        flat = x.reshape(-1, x.shape[-1])  # Qwen3's per-head norms: (num_tokens * heads, head_dim)
        if residual is None:
            return ops.rms_norm(flat, self.weight, self.eps, 2).view(x.shape)
        out, hidden = ops.add_rms_norm(flat, residual.reshape(flat.shape), self.weight, self.eps, 2)
        return out.view(x.shape), hidden.view(x.shape)

    def _forward_triton(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from pagoda.kernels import norm as kernels

        if residual is None:
            # x: (..., hidden_size), e.g. Qwen3's per-head (num_tokens, num_heads, head_dim)
            flat = x.reshape(-1, x.shape[-1])
            return kernels.rms_norm(flat, self.weight, self.eps).view(x.shape)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _cpu_rows(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether pagoda_cpu's norms take these tensors: rows of CPU_ROW_DTYPES, the weight and
    residual of their dtype."""
    same = weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
    return x.dtype in CPU_ROW_DTYPES and same
