"""Rotary position embedding, HF "rotate_half" (GPT-NeoX) layout.

Each head vector is split in halves (x1, x2) rotated pairwise by angle position * inv_freq[i]:
    out = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
cos and sin are precomputed in float32 for positions [0, max_position) and gathered once per
forward (`cos_sin`), then applied to q and k in every layer (`apply_rotary`).

Rope parameters come from `config.rope_parameters` (transformers >= 5: holds rope_theta and
rope_type) or the older `rope_theta` / `rope_scaling` attributes. Types: default, linear, llama3.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings of an HF config as one dict with `rope_type` and `rope_theta` set."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = getattr(hf_config, "rope_scaling", None) or {}
    out = dict(params)
    if any(isinstance(v, dict) for v in out.values()):
        raise ValueError("per-layer-type rope parameters are not supported")
    out.setdefault("rope_type", out.pop("type", "default"))
    if out.get("rope_theta") is None:
        out["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    return out


def compute_inv_freq(params: dict[str, Any], head_dim: int) -> torch.Tensor:
    """(head_dim // 2,) float32 angular frequency of each rotated pair."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Wavelengths longer than orig_len / low_freq_factor are stretched by `factor`, shorter than
    # orig_len / high_freq_factor are kept, and the band between is interpolated linearly in
    # orig_len / wavelength.
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    orig_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > orig_len / low
    short_wave = wavelen < orig_len / high
    smooth = (orig_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(long_wave, inv_freq / factor, blended)
    return torch.where(short_wave, inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    # (max_position, head_dim): cos | sin, computed in float32 and kept in the model's dtype,
    # so a forward gathers its rows without a cast
    cos_sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        inv_freq: torch.Tensor,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        assert inv_freq.shape == (head_dim // 2,)
        self.head_dim = head_dim
        self.max_position = max_position
        positions = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(
            positions, inv_freq.to(positions.device)
        )  # (max_position, head_dim // 2)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # (max_position, head_dim)
        self.register_buffer("cos_sin_cache", cache.to(dtype), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: (num_tokens,) -> cos, sin: (num_tokens, 1, head_dim // 2), broadcast over heads
        cos, sin = self.cos_sin_cache.index_select(0, positions).to(dtype).chunk(2, dim=-1)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: (num_tokens, num_heads * head_dim), k: (num_tokens, num_kv_heads * head_dim)
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary(q, cos, sin, self.head_dim), apply_rotary(k, cos, sin, self.head_dim)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> torch.Tensor:
    # x: (num_tokens, heads * head_dim); cos, sin: (num_tokens, 1, head_dim // 2) -> like x
    num_tokens = x.shape[0]
    x = x.view(num_tokens, -1, head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.view(num_tokens, -1)


def get_rope(
    hf_config: Any, head_dim: int, max_position: int, dtype: torch.dtype = torch.float32
) -> RotaryEmbedding:
    """The rotary embedding an HF config asks for, its angles kept in `dtype`; ValueError for an
    unsupported rope type."""
    inv_freq = compute_inv_freq(rope_parameters(hf_config), head_dim)
    return RotaryEmbedding(head_dim, max_position, inv_freq, dtype)
