"""One layer's paged KV cache and its int8 / fp8 quantization (per token and kv head).

The runner allocates these; attention layers and kernels read and write them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.model_config import ModelConfig

# Quantized K/V rows are stored with one scale of this dtype per (token, kv head); config.py
# names it (KV_SCALE_DTYPE) for sizing.
KV_SCALE_DTYPE = torch.float32

# An all-zero row gets this scale rather than 0, so quantizing it divides by a positive number.
_MIN_SCALE = torch.finfo(KV_SCALE_DTYPE).tiny


@dataclass
class KVCache:
    """One layer's paged KV cache.

    k, v: (num_blocks, block_size, num_kv_heads, head_dim) in the model dtype, or quantized
    (int8, float8_e4m3fn) with k_scale, v_scale: (num_blocks, block_size, num_kv_heads) float32
    such that a stored row dequantizes to values * scale. Scales are None when not quantized.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        quant_dtype: torch.dtype | None,
        device: torch.device | str,
    ) -> KVCache:
        """Zeroed cache in `dtype`, or in `quant_dtype` with scales when that is not None."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if quant_dtype is None:
            k = torch.zeros(shape, dtype=dtype, device=device)
            v = torch.zeros(shape, dtype=dtype, device=device)
            return cls(k, v)
        k = torch.zeros(shape, dtype=quant_dtype, device=device)
        v = torch.zeros(shape, dtype=quant_dtype, device=device)
        k_scale = torch.zeros(shape[:3], dtype=KV_SCALE_DTYPE, device=device)
        v_scale = torch.zeros(shape[:3], dtype=KV_SCALE_DTYPE, device=device)
        return cls(k, v, k_scale, v_scale)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block id first: k, v and, when quantized, their scales."""
        tensors = [self.k, self.v]
        if self.k_scale is not None and self.v_scale is not None:
            tensors += [self.k_scale, self.v_scale]
        return tensors

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block dst[i] becomes a copy of block src[i] (copy-on-write), scales included."""
        for t in self.tensors():
            t[dst] = t[src]


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of each row of the last dim: x ~= values * scale[..., None].

    x: (..., head_dim) -> values (..., head_dim) in `dtype` (int8 or float8_e4m3fn) and scale (...)
    float32 = max|row| / 127 (int8, rounded to nearest) or / 448 (fp8, the e4m3 maximum).
    """
    xf = x.to(KV_SCALE_DTYPE)
    qmax = 127.0 if dtype == torch.int8 else torch.finfo(dtype).max
    scale = (xf.abs().amax(dim=-1) / qmax).clamp_min_(_MIN_SCALE)
    y = (xf / scale.unsqueeze(-1)).clamp_(-qmax, qmax)
    if dtype == torch.int8:
        y = y.round_()
    return y.to(dtype), scale


def dequantize_kv(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values (..., head_dim), scale (...) -> values * scale as `dtype` (computed in float32)."""
    return (values.to(KV_SCALE_DTYPE) * scale.unsqueeze(-1)).to(dtype)


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    quant_dtype: torch.dtype | None,
    device: torch.device | str,
) -> list[KVCache]:
    """A zeroed KVCache per layer of the model `config` describes, in its dtype (or quant_dtype
    with scales)."""
    dtype = getattr(torch, config.dtype)
    return [
        KVCache.allocate(
            num_blocks,
            block_size,
            config.num_kv_heads_per_rank,
            config.head_dim,
            dtype,
            quant_dtype,
            device,
        )
        for _ in range(config.num_layers_per_rank)
    ]


def kv_cache_bytes(caches: list[KVCache]) -> int:
    """Bytes of every tensor of the caches (k, v and any scales)."""
    return sum(t.numel() * t.element_size() for c in caches for t in c.tensors())
