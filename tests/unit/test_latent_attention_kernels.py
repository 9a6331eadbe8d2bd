"""Multi-head latent attention (DeepSeek's MLA, absorbed form) over a latent paged cache in every
backend against a dense float64 reference: per request its cache rows c = [latent, rotary key]
(RANK + ROPE values, one row per token shared by every head), the query row q' at position p
attending to rows j <= p, scores q' . c_j * scale, values c_j[:RANK].

Backends: LatentAttention's torch path (SDPA over the gathered rows, the reference the others are
held to), the C++ CPU ops with `value_dim` (paged_attention.cpp, every instruction set this CPU
has; skipped where they cannot be built), the Triton kernels of pagoda/kernels/latent_attention.py
(under Triton's interpreter without a GPU; decode split or not, a quantized cache), and
LatentAttention.forward on each backend, which also writes the step's rows.

Every case fills the cache with junk first and points table entries past a request's pages at
junk blocks: a position a row must not see shows up as a mismatch. Tolerances are the attention
tests': float32 sums of a few hundred terms 1e-5 (Triton's float32 dots rtol 1e-4).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch

from pagoda.kernels.cpu import built
from pagoda.layers.forward_context import AttentionMetadata, ForwardContext
from pagoda.layers.kv_cache import KVCache, read_kv, write_kv_cache
from pagoda.layers.latent_attention import LatentAttention
from pagoda.runner.step_inputs import build_attention_metadata
from tests.triton_interpreter import interpreter_as_gpu  # noqa: F401 (a fixture, by name)

OPS = built()
ISAS = [] if OPS is None else list(range(OPS.isa() + 1))
needs_ops = pytest.mark.skipif(OPS is None, reason="the CPU kernels cannot be built here")
JUNK_BLOCKS = 3
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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


def _dense(
    q: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, rank: int, scale: float
) -> torch.Tensor:
    scores = torch.einsum("nhd,ld->hnl", q.double(), rows.double()) * scale
    visible = torch.arange(rows.shape[0]).unsqueeze(0) <= positions.unsqueeze(1)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnl,ld->nhd", probs, rows[:, :rank].double()).float()


def _step(case: Case, seed: int = 0, quant: torch.dtype | None = None) -> Step:
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
        expected.append(_dense(q[span], rows, positions, rank, scale))
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


def _close(out: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, rtol=rtol, atol=1e-5)


def _forward(step: Step, case: Case, backend: str, cpu_kernel: bool) -> torch.Tensor:
    """LatentAttention.forward of the step (its rows written again, as a model step writes)."""
    layer = LatentAttention(case.heads, case.rank, step.scale, 0)
    layer.backend, layer.cpu_kernel = backend, cpu_kernel
    return layer(step.q, step.rows, ForwardContext(step.meta, [step.cache]))


# ---- the torch path ------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", [None, torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_torch_path_matches_the_dense_reference(name: str, quant: torch.dtype | None) -> None:
    step = _step(CASES[name], 1, quant)
    _close(_forward(step, CASES[name], "torch", False), step.expected)


# ---- the C++ CPU ops -----------------------------------------------------------------------------


@needs_ops
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", list(DECODES))
def test_cpu_decode_matches_the_dense_reference(threads: int, isa: int, name: str) -> None:
    assert OPS is not None
    case, s = DECODES[name], _step(DECODES[name])
    out = OPS.paged_decode_attention(
        s.q, s.cache.k, s.cache.v, s.tables, s.lens, s.scale, 0, isa, case.rank
    )
    _close(out, s.expected)


@needs_ops
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_rows_match_the_reference_and_keep_their_decode_bits(
    threads: int, isa: int, name: str
) -> None:
    """Every row of a mixed step is close to the reference and the bits of
    paged_decode_attention of that row alone at its position (the determinism contract)."""
    assert OPS is not None
    case, s = CASES[name], _step(CASES[name], 2)
    k, v = s.cache.k, s.cache.v
    out = OPS.paged_attention(s.q, k, v, s.tables, s.starts, s.lens, s.scale, 0, isa, case.rank)
    _close(out, s.expected)
    for r, (q_len, seq_len) in enumerate(zip(case.query_lens, case.seq_lens, strict=True)):
        for i in range(q_len):
            t = int(s.starts[r]) + i
            length = torch.tensor([seq_len - q_len + i + 1], dtype=torch.int32)
            alone = OPS.paged_decode_attention(
                s.q[t : t + 1], k, v, s.tables[r : r + 1], length, s.scale, 0, isa, case.rank
            )
            assert torch.equal(out[t : t + 1], alone), (r, i)


@needs_ops
@pytest.mark.parametrize("name", ["tiny", "mixed", "v3-prompt"])
def test_the_layer_on_the_cpu_kernels_matches_its_torch_path(name: str) -> None:
    case = CASES[name]
    step = _step(case, 3)
    _close(_forward(step, case, "torch", True), _forward(step, case, "torch", False))


@needs_ops
def test_cpu_ops_refuse_a_latent_call_they_cannot_take() -> None:
    assert OPS is not None
    s = _step(DECODES["tiny"])
    args = (s.q, s.cache.k, s.cache.v, s.tables, s.lens, s.scale, 0, 2)
    with pytest.raises(RuntimeError, match="value_dim"):
        OPS.paged_decode_attention(*args, 49)  # past the row's 48 values
    full_v = torch.zeros_like(s.cache.k)
    with pytest.raises(RuntimeError, match="v_cache empty"):
        OPS.paged_decode_attention(s.q, s.cache.k, full_v, *args[3:], 32)
    with pytest.raises(RuntimeError, match="the same shape"):
        OPS.paged_decode_attention(*args)  # value_dim 0 with the empty values


# ---- Triton (a GPU, or its interpreter) ----------------------------------------------------------


@pytest.mark.usefixtures("interpreter_as_gpu")
@pytest.mark.parametrize("quant", [None, torch.int8], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", ["tiny", "odd", "v3-shape"])
def test_triton_decode_matches_the_dense_reference(
    name: str, splits: int, quant: torch.dtype | None
) -> None:
    from pagoda.kernels.latent_attention import latent_decode_attention

    case = DECODES[name]
    s = _step(case, 4, quant)
    dev = torch.device(DEVICE)
    cache = KVCache(*(t.to(dev) for t in s.cache.tensors()))
    q = s.q.to(dev)
    out = torch.full((q.shape[0], case.heads, case.rank), float("nan"), device=dev)
    token_idx = torch.arange(q.shape[0], device=dev)
    latent_decode_attention(
        q, out, cache, token_idx, s.tables.to(dev), s.lens.to(dev), s.scale, splits
    )
    _close(out.cpu(), s.expected, rtol=1e-4)


@pytest.mark.usefixtures("interpreter_as_gpu")
@pytest.mark.parametrize("quant", [None, torch.int8], ids=str)
@pytest.mark.parametrize("name", ["mixed", "odd-mixed", "v3-prompt"])
def test_triton_layer_matches_the_dense_reference(name: str, quant: torch.dtype | None) -> None:
    """LatentAttention.forward on the triton backend: the step's rows written by Triton, then
    decodes and prefill chunks in one step."""
    case = MIXED[name]
    s = _step(case, 5, quant)
    dev = torch.device(DEVICE)
    cache = KVCache(*(t.to(dev) for t in s.cache.tensors()))
    meta = build_attention_metadata(
        case.query_lens, case.seq_lens, s.tables.tolist(), case.block_size, dev
    )
    layer = LatentAttention(case.heads, case.rank, s.scale, 0)
    layer.backend = "triton"
    out = layer(s.q.to(dev), s.rows.to(dev), ForwardContext(meta, [cache]))
    _close(out.cpu(), s.expected, rtol=1e-4)
