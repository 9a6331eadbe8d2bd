"""decode_attention_reductions (the decode attention torch.compile runs) against the reference
paged_attention_torch (SDPA over gathered keys), eagerly: batches of 1 and 4, GQA ratios 1 and
3, float / int8 / fp8 caches, sequences ending inside and exactly at a block boundary, and
shuffled block tables. Every cache slot holds random rows, so a shorter request's table
columns past its length (zero: block 0) point at junk that must be masked out."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.paged_cache import KVCache
from pagoda.layers.attention import (
    decode_attention_reductions,
    paged_attention_torch,
    write_kv_cache,
)
from pagoda.runner.step_inputs import build_attention_metadata

BLOCK = 4
HEAD_DIM = 16
NUM_BLOCKS = 24
QUANT = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _filled_cache(kv_heads: int, quant: torch.dtype | None, gen: torch.Generator) -> KVCache:
    """Every slot written with random rows, so unused blocks hold junk the kernels must skip."""
    cache = KVCache.allocate(NUM_BLOCKS, BLOCK, kv_heads, HEAD_DIM, torch.float32, quant, "cpu")
    n = NUM_BLOCKS * BLOCK
    k = torch.randn(n, kv_heads, HEAD_DIM, generator=gen) * 3
    v = torch.randn(n, kv_heads, HEAD_DIM, generator=gen)
    write_kv_cache(k, v, cache, torch.arange(n))
    return cache


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2)])
@pytest.mark.parametrize("seq_lens", [[7], [1, 8, 13, 4]])
def test_reductions_match_sdpa_reference(
    kv: str, heads: int, kv_heads: int, seq_lens: list[int]
) -> None:
    gen = torch.Generator().manual_seed(len(seq_lens) * 10 + heads)
    cache = _filled_cache(kv_heads, QUANT[kv], gen)
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    width = max(-(-s // BLOCK) for s in seq_lens)
    tables = [order[i * width : (i + 1) * width] for i in range(len(seq_lens))]
    meta = build_attention_metadata([1] * len(seq_lens), seq_lens, tables, BLOCK)
    q = torch.randn(len(seq_lens), heads, HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5

    expected = paged_attention_torch(q, cache, meta, scale)
    got = decode_attention_reductions(
        q, cache, meta.decode_block_tables, meta.decode_seq_lens, scale
    )
    assert got.shape == expected.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
