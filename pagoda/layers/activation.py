"""Gated activations over a fused gate_up projection: silu(gate) * up, gelu_tanh(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.norm import CPU_ROW_DTYPES


class SiluAndMul(nn.Module):
    backend = "torch"  # or "triton" (pagoda/kernels/activation.py), set by the model runner
    # CPU_ROW_DTYPES on pagoda's C++ kernels (kernels/cpu/row_ops.cpp); set likewise
    cpu_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, 2 * d), gate in the first half, up in the second -> (num_tokens, d)
        if self.cpu_kernel and x.dtype in CPU_ROW_DTYPES and x.dim() == 2:
            return torch.ops.pagoda_cpu.silu_and_mul(x, 2)
        if self.backend == "triton":
            from pagoda.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up (Gemma's GeGLU, HF's "gelu_pytorch_tanh"): torch, or pagoda's C++
    kernels on CPU (the same function in eager and compiled steps, as SiluAndMul's)."""

    # CPU_ROW_DTYPES on pagoda's C++ kernels (kernels/cpu/row_ops.cpp); set by the model runner
    cpu_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, 2 * d), gate in the first half, up in the second -> (num_tokens, d)
        if self.cpu_kernel and x.dtype in CPU_ROW_DTYPES and x.dim() == 2:
            return torch.ops.pagoda_cpu.gelu_tanh_and_mul(x, 2)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
