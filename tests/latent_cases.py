"""Steps of multi-head latent attention over a latent paged cache (DeepSeek's MLA, absorbed form)
with their dense float64 reference, for the CPU and Triton kernel tests
(tests/unit/test_latent_attention_kernels.py, tests/unit/test_triton_latent_attention.py): per
request its cache rows c = [latent, rotary key] (RANK + ROPE values, one row per token shared by
every head), the query row q' at position p attending to rows j <= p, scores q' . c_j * scale,
values c_j[:RANK].

Every step fills the cache with junk first and points table entries past a request's pages at
junk blocks: a position a row must not see shows up as a mismatch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pagoda.kernels.paged_cache import KVCache
from pagoda.layers.forward_context import AttentionMetadata
from pagoda.layers.kv_cache import read_kv, write_kv_cache
from pagoda.runner.step_inputs import build_attention_metadata

JUNK_BLOCKS = 3


class Case(NamedTuple):
    query_lens: list[int]
    seq_lens: list[int]
    heads: int
    rank: int
    rope: int
    block_size: int


# V3's head split (512 + 64) at few heads; the tiny model's (32 + 16); widths not multiples of
# 8 or 16 (the kernels' vector tails); a prompt past MAX_CHUNK (256) positions.
DECODES = {
    "v3-shape": Case([1] * 3, [1, 40, 131], 4, 512, 64, 16),
    "tiny": Case([1] * 4, [3, 17, 64, 300], 8, 32, 16, 4),
    "odd": Case([1] * 2, [9, 70], 3, 20, 12, 8),
}
MIXED = {
    "mixed": Case([1, 12, 1, 30, 5], [30, 50, 9, 30, 25], 8, 32, 16, 4),
    "chunk-after-context": Case([40, 1], [300, 77], 4, 64, 16, 16),
    "v3-prompt": Case([20], [20], 2, 512, 64, 16),
    "odd-mixed": Case([7, 1], [15, 4], 3, 20, 12, 8),
}
CASES = {**DECODES, **MIXED}


class Step(NamedTuple):
    q: torch.Tensor  # (num_tokens, H, RANK + ROPE): every absorbed query row of the step
    rows: torch.Tensor  # (num_tokens, RANK + ROPE): the step's own rows (already in the cache)
    cache: KVCache
    meta: AttentionMetadata
    tables: torch.Tensor  # (R, width) int32, a view of a wider buffer of junk ids
    starts: torch.Tensor  # (R + 1,) int32
    lens: torch.Tensor  # (R,) int32
    scale: float
    expected: torch.Tensor  # (num_tokens, H, RANK) the dense reference


def dense(
    q: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, rank: int, scale: float
) -> torch.Tensor:
    scores = torch.einsum("nhd,ld->hnl", q.double(), rows.double()) * scale
    visible = torch.arange(rows.shape[0]).unsqueeze(0) <= positions.unsqueeze(1)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnl,ld->nhd", probs, rows[:, :rank].double()).float()


def make_step(case: Case, seed: int = 0, quant: torch.dtype | None = None) -> Step:
    query_lens, seq_lens, heads, rank, rope, bs = case
    width = rank + rope
    scale = (width // 3) ** -0.5  # a qk head size's, not the row's
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(pages) + JUNK_BLOCKS
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    owned = [perm[sum(pages[:i]) : sum(pages[: i + 1])] for i in range(len(pages))]
    junk = perm[sum(pages) :]
    cache = KVCache.allocate(num_blocks, bs, 1, width, torch.float32, quant, "cpu", v_head_dim=0)
    every = torch.randn(num_blocks * bs, 1, width, generator=gen) * 3 + 4
    write_kv_cache(every, every[:, :, :0], cache, torch.arange(num_blocks * bs))
    q = torch.randn(sum(query_lens), heads, width, generator=gen) * 0.5
    new_rows, expected = [], []
    for r, (seq_len, blocks) in enumerate(zip(seq_lens, owned, strict=True)):
        rows = torch.randn(seq_len, width, generator=gen)
        pos = torch.arange(seq_len)
        slots = torch.tensor(blocks)[pos // bs] * bs + pos % bs
        write_kv_cache(rows.unsqueeze(1), rows[:, None, :0], cache, slots)
        positions = pos[seq_len - query_lens[r] :]
        new_rows.append(rows[positions])
        if quant is not None:  # what every backend reads: the dequantized rows
            rows = read_kv(cache, torch.tensor(blocks), torch.float32, seq_len)[0][:, 0]
        span = slice(sum(query_lens[:r]), sum(query_lens[: r + 1]))
        expected.append(dense(q[span], rows, positions, rank, scale))
    meta = build_attention_metadata(query_lens, seq_lens, owned, bs)
    buf = torch.tensor(junk, dtype=torch.int32)[
        torch.randint(len(junk), (len(pages), max(pages) + 4), generator=gen)
    ]
    for i, ids in enumerate(owned):
        buf[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    starts = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return Step(
        q,
        torch.cat(new_rows),
        cache,
        meta,
        buf[:, : max(pages) + 1],
        starts,
        lens,
        scale,
        torch.cat(expected),
    )


def close(out: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, rtol=rtol, atol=1e-5)
