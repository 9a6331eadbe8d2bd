"""The CPU KV cache's pages are faulted in by a background thread right after it is mapped
(pagoda/layers/kv_cache.py: prefault_in_background): the cache becomes resident without its
contents changing, even while it is being written, and the map itself stays instant."""

from __future__ import annotations

import mmap

import numpy as np
import torch

from pagoda.kernels.paged_cache import KVCache, prefault_in_background


def _resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, all) pages of t's memory: the present bit of each page's entry in
    /proc/self/pagemap, so nothing else the process maps or frees meanwhile counts."""
    page = mmap.PAGESIZE
    first = t.data_ptr() // page
    end = (t.data_ptr() + t.numel() * t.element_size() - 1) // page + 1
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((end - first) * 8), dtype="<u8")
    return int((entries >> np.uint64(63)).sum()), end - first


def test_pages_become_resident_and_contents_stay() -> None:
    # 2 x 64 MiB of float32, never touched: mapped zero pages, not resident.
    cache = KVCache.allocate(2048, 16, 8, 64, torch.float32, None, "cpu")
    assert _resident_pages(cache.v)[0] == 0
    # Written while the thread faults pages in: the writes must survive.
    thread = prefault_in_background([cache])
    assert thread is not None
    cache.k[7] = 1.5
    cache.v[2047] = -2.0
    thread.join(timeout=60)
    assert not thread.is_alive()
    for t in (cache.k, cache.v):
        resident, pages = _resident_pages(t)
        assert resident == pages >= 64 * 2**20 // mmap.PAGESIZE, (resident, pages)
    assert torch.all(cache.k[7] == 1.5) and torch.all(cache.v[2047] == -2.0)
    assert cache.k[:7].abs().sum() == 0 and cache.v[:2047].abs().sum() == 0


def test_quantized_caches_and_scales_too() -> None:
    cache = KVCache.allocate(512, 16, 4, 64, torch.float32, torch.int8, "cpu")
    cache.k_scale[3] = 0.25  # type: ignore[index]
    thread = prefault_in_background([cache])
    assert thread is not None
    thread.join(timeout=60)
    assert torch.all(cache.k_scale[3] == 0.25)  # type: ignore[index]
    assert cache.k.abs().sum() == 0
