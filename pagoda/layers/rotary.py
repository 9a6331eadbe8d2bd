"""Rotary position embedding, HF "rotate_half" (GPT-NeoX) layout.

Each head vector is split in halves (x1, x2) rotated pairwise by angle position * inv_freq[i]:
    out = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
cos and sin are precomputed in float32 for positions [0, max_position) and gathered once per
forward (`cos_sin`), then applied to q and k in every layer (`apply_rotary`).

Rope parameters come from `config.rope_parameters` (transformers >= 5: holds rope_theta and
rope_type) or the older `rope_theta` / `rope_scaling` attributes. Types: default, linear, llama3,
longrope (Phi-3: short factors up to original_max_position_embeddings, long factors past it, cos
and sin scaled by the attention factor), yarn, and freq_factors (a GGUF file's `rope_freqs`
tensor, each frequency divided by its factor: how llama.cpp keeps Llama 3's scaling). With partial_rotary_factor < 1 (Phi-4-mini) only the
first rotary_dim = head_dim * factor values of each head rotate (`apply_partial_rotary`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "freq_factors")


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


def rotary_dim_of(params: dict[str, Any], head_dim: int) -> int:
    """The rotated values of each head: head_dim, or its partial_rotary_factor share."""
    return int(head_dim * float(params.get("partial_rotary_factor", 1.0)))


def compute_inv_freq(params: dict[str, Any], rotary_dim: int, long: bool = False) -> torch.Tensor:
    """(rotary_dim // 2,) float32 angular frequency of each rotated pair (longrope: its short
    factors, or with `long` its long ones)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if rope_type == "longrope":
        factors = params["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents)
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    elif rope_type == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, params, base, rotary_dim)
    elif rope_type == "freq_factors":
        inv_freq = inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float32)
    return inv_freq


def yarn_factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    """YaRN's context factor: `factor`, else max_position_embeddings over the original length."""
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / float(params["original_max_position_embeddings"])
    return float(factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `scale`: 0.1 * mscale * ln(scale) + 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    """The factor YaRN multiplies cos and sin by (HF's rule: `attention_factor`, else the
    ratio of the mscale and mscale_all_dim temperatures when both are set, else mscale(factor))."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = yarn_factor(params, max_position_embeddings)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def _yarn_inv_freq(
    inv_freq: torch.Tensor, params: dict[str, Any], base: float, rotary_dim: int
) -> torch.Tensor:
    # Pairs turning fewer than beta_slow times over the original context are interpolated
    # (inv_freq / factor), more than beta_fast times kept, and a linear ramp blends between.
    factor = float(params["factor"])  # get_rope fills it in when the config has none
    original = float(params["original_max_position_embeddings"])
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation


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
        long_inv_freq: torch.Tensor | None = None,
        long_from: int = 0,
        scaling: float = 1.0,
    ) -> None:
        """head_dim: the rotated values per head. Positions from `long_from` on rotate by
        `long_inv_freq` when given (longrope); cos and sin are multiplied by `scaling`."""
        super().__init__()
        assert inv_freq.shape == (head_dim // 2,)
        self.head_dim = head_dim
        self.max_position = max_position
        positions = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(
            positions, inv_freq.to(positions.device)
        )  # (max_position, head_dim // 2)
        if long_inv_freq is not None and long_from < max_position:
            long = torch.outer(positions[long_from:], long_inv_freq.to(positions.device))
            freqs = torch.cat((freqs[:long_from], long))
        cos, sin = freqs.cos(), freqs.sin()
        if scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
        cache = torch.cat((cos, sin), dim=-1)  # (max_position, head_dim)
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


def apply_partial_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, rotary_dim: int
) -> torch.Tensor:
    """apply_rotary on the first rotary_dim values of each head; the rest pass through.
    x: (num_tokens, heads * head_dim); cos, sin: (num_tokens, 1, rotary_dim // 2) -> like x"""
    num_tokens = x.shape[0]
    heads = x.view(num_tokens, -1, head_dim)
    rot = heads[..., :rotary_dim].reshape(num_tokens, -1)
    rot = apply_rotary(rot, cos, sin, rotary_dim).view(num_tokens, -1, rotary_dim)
    return torch.cat((rot, heads[..., rotary_dim:]), dim=-1).view(num_tokens, -1)


def get_rope(
    hf_config: Any, head_dim: int, max_position: int, dtype: torch.dtype = torch.float32
) -> RotaryEmbedding:
    """The rotary embedding an HF config asks for (over rotary_dim_of(head_dim) values), its
    angles kept in `dtype`; ValueError for an unsupported rope type.

    longrope: HF switches every position of a forward to the long factors once the sequence
    passes original_max_position_embeddings (and keeps what its cache holds); here a position's
    angle depends on the position alone: short factors before it, long from it. The two agree
    on every sequence within the original context."""
    params = rope_parameters(hf_config)
    rotary_dim = rotary_dim_of(params, head_dim)
    if params["rope_type"] == "yarn":
        max_positions = int(hf_config.max_position_embeddings)
        scale = yarn_attention_factor(params, max_positions)
        params["factor"] = yarn_factor(params, max_positions)
        inv_freq = compute_inv_freq(params, rotary_dim)
        return RotaryEmbedding(rotary_dim, max_position, inv_freq, dtype, scaling=scale)
    inv_freq = compute_inv_freq(params, rotary_dim)
    if params["rope_type"] != "longrope":
        return RotaryEmbedding(rotary_dim, max_position, inv_freq, dtype)
    original = int(
        params.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings
    )
    factor = params.get("factor") or hf_config.max_position_embeddings / original
    scaling = params.get("attention_factor")
    if scaling is None:
        scaling = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    long_inv_freq = compute_inv_freq(params, rotary_dim, long=True)
    return RotaryEmbedding(
        rotary_dim, max_position, inv_freq, dtype, long_inv_freq, original, float(scaling)
    )
