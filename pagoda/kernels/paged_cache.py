"""One layer's paged KV cache as tensors (KVCache), the dtype of its quantized rows' scales, how
the cache's memory is allocated and counted, and whole blocks copied out and in (the KV
connector's worker side: runner/executor.py). What every kernel and layer reads the cache as:
plain torch, below the layers (layers/kv_cache.py writes and reads it by slot and block) and
the Triton kernels (kernels/kv_cache.py, attention.py, latent_attention.py).
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

# Quantized K/V rows are stored with one scale of this dtype per (token, kv head); model_config.py
# names it (KV_SCALE_DTYPE) for sizing.
KV_SCALE_DTYPE = torch.float32
# The storage dtypes kept with scales (--kv-cache-dtype int8, fp8).
SCALED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)


@dataclass
class KVCache:
    """One layer's paged KV cache.

    k, v: (num_blocks, block_size, num_kv_heads, head_dim) in the model dtype or a 16-bit float
    (`--kv-cache-dtype bfloat16|float16`), or quantized (int8, float8_e4m3fn) with k_scale,
    v_scale: (num_blocks, block_size, num_kv_heads) float32 such that a stored row dequantizes to
    values * scale. Scales are None when not quantized.
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
        kv_dtype: torch.dtype | None,
        device: torch.device | str,
        v_head_dim: int | None = None,
    ) -> KVCache:
        """Zeroed cache in `kv_dtype` (None: the model's `dtype`), with scales where that is int8
        or float8_e4m3fn; values of v_head_dim (head_dim when None; 0 for a latent cache, whose
        v is empty)."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        v_shape = shape[:3] + (head_dim if v_head_dim is None else v_head_dim,)
        if kv_dtype is None or kv_dtype not in SCALED_KV_DTYPES:
            store = dtype if kv_dtype is None else kv_dtype
            return cls(_zeros(shape, store, device), _zeros(v_shape, store, device))
        k = _zeros(shape, kv_dtype, device)
        v = _zeros(v_shape, kv_dtype, device)
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


def kv_cache_bytes(caches: list[KVCache]) -> int:
    """Bytes of every tensor of the caches (k, v and any scales)."""
    return sum(t.numel() * t.element_size() for c in caches for t in c.tensors())


# [dtype name, per-block shape] of each cache tensor, layer after layer
Layout = list[tuple[str, list[int]]]


def cache_layout(caches: Sequence[KVCache]) -> Layout:
    return [
        (str(t.dtype).removeprefix("torch."), list(t.shape[1:]))
        for cache in caches
        for t in cache.tensors()
    ]


def gather_blocks(caches: Sequence[KVCache], block_ids: list[int]) -> list[torch.Tensor]:
    """Host copies of the blocks, one tensor (len(block_ids), ...) per cache tensor."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=caches[0].k.device)
    return [t.index_select(0, index).cpu() for cache in caches for t in cache.tensors()]


def scatter_blocks(
    caches: Sequence[KVCache], block_ids: list[int], data: Sequence[torch.Tensor]
) -> None:
    """Write gather_blocks' tensors (their first len(block_ids) blocks) into these blocks."""
    tensors = [t for cache in caches for t in cache.tensors()]
    index = torch.tensor(block_ids, dtype=torch.int64, device=tensors[0].device)
    for t, d in zip(tensors, data, strict=True):
        t.index_copy_(0, index, d[: len(block_ids)].to(t.device))
