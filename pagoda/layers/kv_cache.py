"""One layer's paged KV cache and its int8 / fp8 quantization (per token and kv head).

The runner allocates these; attention layers and kernels read and write them: write_kv_cache by
flat slot, read_kv by blocks (the torch backend's reference reads and writes).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import threading
from collections.abc import Sequence
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
        v_head_dim: int | None = None,
    ) -> KVCache:
        """Zeroed cache in `dtype`, or in `quant_dtype` with scales when that is not None;
        values of v_head_dim (head_dim when None; 0 for a latent cache, whose v is empty)."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        v_shape = shape[:3] + (head_dim if v_head_dim is None else v_head_dim,)
        if quant_dtype is None:
            return cls(_zeros(shape, dtype, device), _zeros(v_shape, dtype, device))
        k = _zeros(shape, quant_dtype, device)
        v = _zeros(v_shape, quant_dtype, device)
        k_scale = _zeros(shape[:3], KV_SCALE_DTYPE, device)
        v_scale = _zeros(shape[:3], KV_SCALE_DTYPE, device)
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


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (not in Python's mmap module before 3.13)


def prefault_in_background(caches: Sequence[KVCache]) -> threading.Thread | None:
    """Fault in the pages of CPU caches made by _zeros, in a daemon thread, without changing
    their contents (MADV_POPULATE_WRITE), so it may run while steps write them. The cache's
    memory is then resident from the start, as a torch.zeros cache was (an out-of-memory shows
    at once, not hours later, and RSS stays flat), while the server is ready as soon as the map
    exists. None on another device or where the kernel lacks it."""
    tensors = [t for c in caches for t in c.tensors() if t.device.type == "cpu" and t.numel()]
    if not tensors:
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def run() -> None:
        page = mmap.PAGESIZE
        for t in tensors:  # ctypes releases the GIL for the call
            start = t.data_ptr() // page * page
            nbytes = t.data_ptr() + t.numel() * t.element_size() - start
            if madvise(start, nbytes, _MADV_POPULATE_WRITE) != 0:
                logging.getLogger(__name__).debug(
                    "MADV_POPULATE_WRITE: errno %d", ctypes.get_errno()
                )
                return

    thread = threading.Thread(target=run, name="pagoda-kv-prefault", daemon=True)
    thread.start()
    return thread


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros; on CPU over an anonymous memory map, whose pages the OS hands out zeroed on
    first touch: a cache of gigabytes is allocated at once (torch.zeros writes every byte, about
    a second for the default 2 GiB), and blocks never used take no memory."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # The tensor holds a reference to the map, which lives as long as the tensor.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


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


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    # k, v: (num_tokens, num_kv_heads, head_dim); slot_mapping: (num_tokens,) flat slot ids
    if cache.k_scale is None or cache.v_scale is None:
        k_flat = cache.k.view(-1, *cache.k.shape[2:])
        k_flat.index_copy_(0, slot_mapping, k.to(cache.k.dtype))
        if cache.v.shape[-1]:  # a latent cache (MLA) has no values
            v_flat = cache.v.view(-1, *cache.v.shape[2:])
            v_flat.index_copy_(0, slot_mapping, v.to(cache.v.dtype))
        return
    _write_quantized(k, cache.k, cache.k_scale, slot_mapping)
    _write_quantized(v, cache.v, cache.v_scale, slot_mapping)


def _write_quantized(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if x.shape[-1] == 0:  # a latent cache's values: nothing stored
        return
    q, scale = quantize_kv(x, values.dtype)
    # Copied as bytes: CPU index_copy_ has no float8 kernel (torch 2.13); int8 copies the same.
    flat = values.view(torch.uint8).view(-1, *values.shape[2:])
    flat.index_copy_(0, slot_mapping, q.view(torch.uint8))
    scales.view(-1, scales.shape[-1]).index_copy_(0, slot_mapping, scale)


def gather_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, length: int | None = None
) -> torch.Tensor:
    """(num_blocks, block_size, *rest)[ids] -> (*ids.shape[:-1], n * block_size, *rest),
    cut to the first `length` positions when given."""
    dim = block_ids.dim()
    if torch.compiler.is_compiling():
        # Indexing keeps ids' shape (flattening ids, or the gathered blocks, makes
        # torch.compile guard on whether the batch or the table width is 1).
        out = cache[block_ids]
    else:
        # Eagerly, index_select is ~3.5x faster than advanced indexing on CPU.
        flat = cache.index_select(0, block_ids.reshape(-1))
        out = flat.view(*block_ids.shape, *cache.shape[1:])
    out = out.flatten(dim - 1, dim)
    return out if length is None else out.narrow(block_ids.dim() - 1, 0, length)


def read_kv(
    cache: KVCache, block_ids: torch.Tensor, dtype: torch.dtype, seq_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of blocks `block_ids` in `dtype`, positions [0, seq_len) when given:
    each (*block_ids.shape[:-1], seq_len or n * block_size, num_kv_heads, head_dim)."""
    k = gather_blocks(cache.k, block_ids, seq_len)
    v = gather_blocks(cache.v, block_ids, seq_len)
    if cache.k_scale is None or cache.v_scale is None:
        return k.to(dtype), v.to(dtype)
    k_scale = gather_blocks(cache.k_scale, block_ids, seq_len)
    v_scale = gather_blocks(cache.v_scale, block_ids, seq_len)
    return dequantize_kv(k, k_scale, dtype), dequantize_kv(v, v_scale, dtype)


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
            config.v_head_dim,
        )
        for _ in range(config.num_layers_per_rank)
    ]


def kv_cache_bytes(caches: list[KVCache]) -> int:
    """Bytes of every tensor of the caches (k, v and any scales)."""
    return sum(t.numel() * t.element_size() for c in caches for t in c.tensors())
