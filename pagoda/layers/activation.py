"""Gated activation over a fused gate_up projection: silu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, 2 * d), gate in the first half, up in the second -> (num_tokens, d)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
