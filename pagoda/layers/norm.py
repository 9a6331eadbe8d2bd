"""RMSNorm, with the residual add of the next sub-block fused in.

Contract (as vLLM's): `norm(x)` returns the normalized x; `norm(x, residual)` first forms
`h = x + residual` and returns `(norm(h), h)`, so a decoder layer carries the running residual
stream without a separate add. Statistics are computed in float32 and cast back before the
weight multiply, as HF transformers does, so fp32 results match HF bit for bit. Backend
`triton` runs the fused kernel of pagoda/kernels/norm.py (same contract, tested against this).
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    backend = "torch"  # or "triton", set by the model runner

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

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
        if residual is None:
            return self._norm(x)
        hidden = x + residual
        return self._norm(hidden), hidden

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
