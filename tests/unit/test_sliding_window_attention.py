"""Sliding-window attention (Mistral, Gemma 3's local layers) in every attention backend against a
plain dense reference: per request the full keys and values of its sequence, the query at
position p attending to keys max(0, p - W + 1) <= j <= p (HF transformers' mask), softmax in
float64.

Backends: the torch reference paged_attention_torch (decode rows by SDPA, prefill rows by
SDPA), decode_attention_reductions (what torch.compile runs), the C++ CPU ops at every
instruction set this CPU has (skipped where they cannot be built), the Triton kernels (under
Triton's interpreter without a GPU), and Attention.forward, which hands each the layer's window,
over float32, int8 and fp8 caches.

Every case fills the whole cache with junk (finite, mean 4) first, scatters each request's blocks
over it, and points the table entries past a request's pages and those of the blocks wholly
before its earliest window at junk blocks: a position outside a window that leaks in shows up
as a mismatch. Batches hold decodes below, at and above the window, prefill chunks after cached
context whose windows start mid-block, prompts longer than the window, GQA and W = 1.

Tolerances are those of the existing attention tests: the CPU ops and the reductions 1e-5 (float32
sums of a few hundred terms), Triton float32 atol 1e-5 / rtol 1e-4; a quantized cache is compared
with the reference over its dequantized keys and values (what every backend reads).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any, NamedTuple, cast

import numpy as np
import pytest
import torch

from pagoda.kernels.cpu import built
from pagoda.kernels.paged_cache import KVCache
from pagoda.layers.attention import (
    Attention,
    decode_attention_reductions,
    paged_attention_torch,
)
from pagoda.layers.forward_context import AttentionMetadata, ForwardContext
from pagoda.layers.kv_cache import read_kv, write_kv_cache
from pagoda.runner.step_inputs import build_attention_metadata
from tests.triton_interpreter import interpreter_as_gpu  # noqa: F401 (a fixture, by name)

OPS = built()
ISAS = [] if OPS is None else list(range(OPS.isa() + 1))
needs_ops = pytest.mark.skipif(OPS is None, reason="the CPU kernels cannot be built here")
QUANT = {"float32": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
JUNK_BLOCKS = 4


class Case(NamedTuple):
    """One step: per request its query rows and length, the window, the shapes."""

    query_lens: list[int]
    seq_lens: list[int]
    window: int
    heads: int
    kv_heads: int
    dim: int
    block_size: int


# Pure decode batches: lengths below, at and above the window (windows starting mid-block), W = 1,
# a head width not a multiple of 8, and a window past MAX_CHUNK (256) positions: several chunks
# from a lo that is no chunk boundary of the row's length.
DECODES = {
    "around-W": Case([1] * 6, [5, 20, 21, 37, 57, 130], 20, 9, 3, 64, 16),
    "W1": Case([1] * 4, [1, 2, 17, 40], 1, 4, 2, 32, 4),
    "odd-dim": Case([1] * 4, [3, 12, 13, 50], 12, 6, 3, 20, 4),
    "long-W": Case([1] * 3, [100, 300, 701], 300, 12, 2, 128, 16),
}
# With prefill rows: a chunk after cached context crossing the window, a whole prompt longer than
# the window (no GQA), decodes and chunks mixed, W = 1, and a prompt chunk past MAX_CHUNK.
MIXED = {
    "chunk-after-context": Case([30], [70], 20, 9, 3, 64, 16),
    "prompt": Case([45], [45], 16, 8, 8, 32, 4),
    "mixed": Case([1, 12, 1, 40, 5, 1], [30, 50, 9, 40, 25, 200], 24, 9, 3, 64, 16),
    "W1-mixed": Case([6, 1, 3], [6, 10, 20], 1, 6, 3, 20, 4),
    "long": Case([300, 1], [700, 650], 300, 12, 2, 128, 16),
}
CASES = {**DECODES, **MIXED}


class Step(NamedTuple):
    q: torch.Tensor  # (num_tokens, H, D): every query row of the step
    k: torch.Tensor  # (num_tokens, Hkv, D): the step's new keys (already in the cache)
    v: torch.Tensor
    cache: KVCache
    meta: AttentionMetadata
    tables: torch.Tensor  # (R, width) int32 the requests' tables, a view of a wider buffer
    starts: torch.Tensor  # (R + 1,) int32 each request's first query row, then num_tokens
    lens: torch.Tensor  # (R,) int32
    expected: torch.Tensor  # the dense reference of every query row


def _dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, window: int
) -> torch.Tensor:
    """Queries q (n, H, D) at `positions` over a sequence's keys and values (L, Hkv, D): each
    sees keys max(0, p - window + 1) <= j <= p (j <= p with window 0); float64 softmax."""
    group = q.shape[1] // k.shape[1]
    keys = k.double().repeat_interleave(group, dim=1)  # (L, H, D)
    values = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), keys) * q.shape[2] ** -0.5
    j = torch.arange(k.shape[0]).unsqueeze(0)
    p = positions.unsqueeze(1)
    visible = (j <= p) & (j > p - window) if window else j <= p  # (n, L)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), values).float()


def _step(case: Case, seed: int = 0, quant: torch.dtype | None = None) -> Step:
    """A case's step over a junk-filled cache (see the module docstring)."""
    query_lens, seq_lens, window, heads, kv_heads, dim, bs = case
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(pages) + JUNK_BLOCKS
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    owned = [perm[sum(pages[:i]) : sum(pages[: i + 1])] for i in range(len(pages))]
    junk = perm[sum(pages) :]
    cache = KVCache.allocate(num_blocks, bs, kv_heads, dim, torch.float32, quant, "cpu")
    every = torch.randn(num_blocks * bs, kv_heads, dim, generator=gen) * 3 + 4
    write_kv_cache(every, every.flip(0), cache, torch.arange(num_blocks * bs))

    q = torch.randn(sum(query_lens), heads, dim, generator=gen) * 2  # peaked and flat rows alike
    seen: list[list[int]] = []
    new_k, new_v, expected = [], [], []
    for r, (seq_len, blocks) in enumerate(zip(seq_lens, owned, strict=True)):
        k = torch.randn(seq_len, kv_heads, dim, generator=gen)
        v = torch.randn(seq_len, kv_heads, dim, generator=gen)
        every_pos = torch.arange(seq_len)
        write_kv_cache(k, v, cache, torch.tensor(blocks)[every_pos // bs] * bs + every_pos % bs)
        positions = every_pos[seq_len - query_lens[r] :]  # the query rows'
        new_k.append(k[positions])
        new_v.append(v[positions])
        if quant is not None:  # what every backend reads: the dequantized rows
            k, v = read_kv(cache, torch.tensor(blocks), torch.float32, seq_len)
        rows = slice(sum(query_lens[:r]), sum(query_lens[: r + 1]))
        expected.append(_dense(q[rows], k, v, positions, window))
        # blocks wholly before the first query row's window: junk ids (nothing may read them)
        first_lo = max(0, int(positions[0]) + 1 - window) if window else 0
        junked = [junk[i % len(junk)] for i in range(first_lo // bs)]
        seen.append(junked + blocks[len(junked) :])

    meta = build_attention_metadata(query_lens, seq_lens, seen, bs)
    width = max(pages) + 1  # a column of junk past the longest, in a wider buffer
    picks = torch.randint(len(junk), (len(pages), width + 3), generator=gen)
    buf = torch.tensor(junk, dtype=torch.int32)[picks]
    for i, ids in enumerate(seen):
        buf[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    starts = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    k_new, v_new = torch.cat(new_k), torch.cat(new_v)
    return Step(q, k_new, v_new, cache, meta, buf[:, :width], starts, lens, torch.cat(expected))


def _close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# ---- the torch reference and the reductions ------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_torch_reference_matches_the_dense_reference(name: str) -> None:
    step = _step(CASES[name])
    out = paged_attention_torch(
        step.q, step.cache, step.meta, step.q.shape[2] ** -0.5, CASES[name].window
    )
    _close(out, step.expected)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("name", ["around-W", "mixed", "W1-mixed"])
def test_torch_reference_over_a_quantized_cache(name: str, kv: str) -> None:
    case = CASES[name]
    step = _step(case, 1, QUANT[kv])
    out = paged_attention_torch(step.q, step.cache, step.meta, case.dim**-0.5, case.window)
    _close(out, step.expected)


def test_torch_reference_keeps_a_decode_mask_per_window() -> None:
    """One step's layers alternate windows (Gemma 3: local and global): each gets its own mask."""
    case = DECODES["around-W"]
    step = _step(case)
    scale = case.dim**-0.5
    for window in (case.window, None, 7, case.window, None):
        fresh = dataclasses.replace(step.meta, decode_mask=None, decode_window_masks={})
        expected = paged_attention_torch(step.q, step.cache, fresh, scale, window)
        assert torch.equal(
            paged_attention_torch(step.q, step.cache, step.meta, scale, window), expected
        )
    assert set(step.meta.decode_window_masks) == {case.window, 7}


@pytest.mark.parametrize("name", list(MIXED))
def test_a_window_covering_every_row_is_full_attention_bit_for_bit(name: str) -> None:
    case = CASES[name]
    step = _step(case._replace(window=0))
    scale = case.dim**-0.5
    full = paged_attention_torch(step.q, step.cache, step.meta, scale)
    wide = dataclasses.replace(step.meta, decode_mask=None)
    assert torch.equal(
        paged_attention_torch(step.q, step.cache, wide, scale, max(case.seq_lens)), full
    )


@pytest.mark.parametrize("kv", list(QUANT))
@pytest.mark.parametrize("name", list(DECODES))
def test_reductions_match_the_dense_reference(name: str, kv: str) -> None:
    case = DECODES[name]
    step = _step(case, 2, QUANT[kv])
    meta = step.meta
    out = decode_attention_reductions(
        step.q,
        step.cache,
        meta.decode_block_tables,
        meta.decode_seq_lens,
        case.dim**-0.5,
        case.window,
    )
    _close(out, step.expected)


# ---- the C++ CPU ops ------------------------------------------------------------------------------


@needs_ops
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", list(DECODES))
def test_cpu_decode_matches_the_dense_reference(threads: int, isa: int, name: str) -> None:
    assert OPS is not None
    case = DECODES[name]
    s = _step(case)
    out = OPS.paged_decode_attention(
        s.q, s.cache.k, s.cache.v, s.tables, s.lens, case.dim**-0.5, case.window, isa
    )
    _close(out, s.expected)


@needs_ops
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_paged_attention_matches_the_dense_reference(threads: int, isa: int, name: str) -> None:
    assert OPS is not None
    case = CASES[name]
    s = _step(case)
    out = OPS.paged_attention(
        s.q, s.cache.k, s.cache.v, s.tables, s.starts, s.lens, case.dim**-0.5, case.window, isa
    )
    _close(out, s.expected)


@needs_ops
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["mixed", "long", "W1-mixed"])
def test_cpu_rows_keep_their_decode_bits_under_a_window(isa: int, name: str) -> None:
    """The determinism contract holds with a window: every row of a mixed step is the bits of
    paged_decode_attention of that row alone at its position (its lo follows from its position)."""
    assert OPS is not None
    case = CASES[name]
    s = _step(case)
    scale = case.dim**-0.5
    out = OPS.paged_attention(
        s.q, s.cache.k, s.cache.v, s.tables, s.starts, s.lens, scale, case.window, isa
    )
    for r, (q_len, seq_len) in enumerate(zip(case.query_lens, case.seq_lens, strict=True)):
        for i in range(q_len):
            t = int(s.starts[r]) + i
            length = torch.tensor([seq_len - q_len + i + 1], dtype=torch.int32)
            alone = OPS.paged_decode_attention(
                s.q[t : t + 1],
                s.cache.k,
                s.cache.v,
                s.tables[r : r + 1],
                length,
                scale,
                case.window,
                isa,
            )
            assert torch.equal(out[t : t + 1], alone), (r, i)


@needs_ops
@pytest.mark.parametrize("isa", ISAS)
def test_cpu_verification_rows_keep_their_bits_under_a_window(threads: int, isa: int) -> None:
    """A request's verification rows (one table, lengths L+1 .. L+k) straddling the window: the
    rows whose window starts at 0 share a pass, the others go alone; each gets its bits alone."""
    assert OPS is not None
    s = _step(Case([60], [60], 40, 9, 3, 64, 16))
    k, v = s.cache.k, s.cache.v
    lens = torch.arange(34, 47, dtype=torch.int32)  # lo 0 up to 40 positions, then 1 .. 6
    table = s.tables.repeat(lens.shape[0], 1)
    queries = torch.randn(lens.shape[0], 9, 64, generator=torch.Generator().manual_seed(3))
    together = OPS.paged_decode_attention(queries, k, v, table, lens, 0.125, 40, isa)
    for b in range(lens.shape[0]):
        one = slice(b, b + 1)
        alone = OPS.paged_decode_attention(
            queries[one], k, v, table[one], lens[one], 0.125, 40, isa
        )
        assert torch.equal(together[one], alone), b
    rows = table[:, : -(-60 // 16)].tolist()
    meta = build_attention_metadata([1] * lens.shape[0], lens.tolist(), rows, 16)
    _close(together, paged_attention_torch(queries, s.cache, meta, 0.125, 40))


@needs_ops
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", list(MIXED))
def test_cpu_window_zero_and_a_covering_window_are_full_attention(isa: int, name: str) -> None:
    """window 0 is the full attention the torch reference computes, and a window at least every
    row's length runs the same operations: the same bits as window 0."""
    assert OPS is not None
    case = CASES[name]
    s = _step(case._replace(window=0))
    scale = case.dim**-0.5
    args = (s.q, s.cache.k, s.cache.v, s.tables, s.starts, s.lens, scale)
    full = OPS.paged_attention(*args, 0, isa)
    _close(full, s.expected)
    _close(full, paged_attention_torch(s.q, s.cache, s.meta, scale))
    assert torch.equal(OPS.paged_attention(*args, max(case.seq_lens), isa), full)


@needs_ops
def test_cpu_ops_refuse_a_negative_window() -> None:
    assert OPS is not None
    s = _step(MIXED["prompt"])
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        OPS.paged_attention(s.q, s.cache.k, s.cache.v, s.tables, s.starts, s.lens, 0.2, -1, 2)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        OPS.paged_decode_attention(s.q[:1], s.cache.k, s.cache.v, s.tables, s.lens, 0.2, -1, 2)


# ---- Triton (the interpreter without a GPU) -------------------------------------------------------


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_kernels(request: pytest.FixtureRequest) -> ModuleType:
    pytest.importorskip("triton")
    from tests.triton_interpreter import check_interpreted

    check_interpreted()
    request.getfixturevalue("interpreter_as_gpu")
    from pagoda.kernels import attention

    return attention


def _on_device(cache: KVCache) -> KVCache:
    return KVCache(*(t.to(DEVICE) if t is not None else None for t in cache.tensors()))


def _triton(kernels: Any, s: Step, window: int, num_splits: int) -> torch.Tensor:
    """Both Triton kernels over a step (on DEVICE), the tables those of the step's rows of
    s.tables; every row must be written."""
    m = s.meta
    q = s.q.to(DEVICE)
    out = torch.full_like(q, float("nan"))
    one_row = s.starts.diff() == 1  # decodes
    scale = s.q.shape[2] ** -0.5
    kernels.paged_decode_attention(
        q,
        out,
        _on_device(s.cache),
        m.decode_token_idx.to(DEVICE),
        s.tables[one_row].to(DEVICE),
        m.decode_seq_lens.to(DEVICE),
        scale,
        num_splits,
        window,
    )
    kernels.paged_prefill_attention(
        q,
        out,
        _on_device(s.cache),
        m.prefill_token_start.to(DEVICE),
        m.prefill_query_lens.to(DEVICE),
        m.prefill_seq_lens.to(DEVICE),
        s.tables[~one_row].to(DEVICE),
        m.max_prefill_query_len,
        scale,
        window,
    )
    return out.cpu()


TRITON_CASES = {
    "around-W": Case([1] * 6, [5, 20, 21, 37, 57, 130], 20, 4, 2, 32, 16),
    "mixed": Case([1, 12, 1, 40, 5, 1, 70], [30, 50, 9, 40, 25, 200, 150], 24, 6, 2, 32, 4),
    "W1": Case([6, 1, 3, 1], [6, 10, 20, 1], 1, 4, 4, 16, 1),
}


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_matches_the_dense_reference(
    triton_kernels: ModuleType, name: str, num_splits: int
) -> None:
    """Decode splits over the pages from the window's start (5 splits leave some empty), prefill
    tiles of 64 rows whose rows' windows start in different key tiles (block sizes 1, 4, 16)."""
    case = TRITON_CASES[name]
    s = _step(case)
    out = _triton(triton_kernels, s, case.window, num_splits)
    torch.testing.assert_close(out, s.expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_triton_over_a_quantized_cache(triton_kernels: ModuleType, kv: str) -> None:
    case = TRITON_CASES["mixed"]
    s = _step(case, 4, QUANT[kv])
    out = _triton(triton_kernels, s, case.window, 3)
    torch.testing.assert_close(out, s.expected, atol=1e-5, rtol=1e-4)


# ---- Attention.forward: each backend gets the layer's window ------------------------------------


def _forward(attn: Attention, s: Step, device: str = "cpu") -> torch.Tensor:
    """attn over the step's rows: it writes their keys and values (the ones already there)."""
    meta, cache = s.meta, s.cache
    if device != "cpu":
        fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
        meta = AttentionMetadata(
            **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
        )
        cache = _on_device(cache)
    tokens = s.q.shape[0]
    flat = [t.to(device).reshape(tokens, -1) for t in (s.q, s.k, s.v)]
    return attn(*flat, ForwardContext(meta, [cache])).view(s.q.shape).cpu()


@pytest.mark.parametrize(
    ("cpu_kernel", "kv"),
    [(False, "float32"), (False, "int8"), (True, "float32"), (True, "int8"), (True, "fp8")],
)
@pytest.mark.parametrize("name", ["mixed", "around-W", "W1-mixed"])
def test_attention_layer_applies_its_window(name: str, cpu_kernel: bool, kv: str) -> None:
    """The torch backend, with the CPU ops (float32 caches) or without; a quantized cache always
    takes the torch reference."""
    if cpu_kernel and OPS is None:
        pytest.skip("the CPU kernels cannot be built here")
    case = CASES[name]
    s = _step(case, 5, QUANT[kv])
    attn = Attention(
        case.heads, case.dim, case.kv_heads, case.dim**-0.5, 0, sliding_window=case.window
    )
    attn.cpu_kernel = cpu_kernel
    _close(_forward(attn, s), s.expected)


@pytest.mark.parametrize(("cpu_kernel", "kv"), [(True, "float32"), (False, "int8")])
def test_compiled_decode_applies_the_window(cpu_kernel: bool, kv: str) -> None:
    """A compiled decode step (runner/compilation.py) traces the C++ op, through its fake, or
    decode_attention_reductions, each with the layer's window."""
    if cpu_kernel and OPS is None:
        pytest.skip("the CPU kernels cannot be built here")
    case = DECODES["around-W"]
    s = _step(case, 7, QUANT[kv])
    attn = Attention(
        case.heads, case.dim, case.kv_heads, case.dim**-0.5, 0, sliding_window=case.window
    )
    attn.cpu_kernel = cpu_kernel
    compiled = torch.compile(attn, fullgraph=True, dynamic=True, backend="eager")
    tokens = s.q.shape[0]
    flat = [t.reshape(tokens, -1) for t in (s.q, s.k, s.v)]
    _close(compiled(*flat, ForwardContext(s.meta, [s.cache])).view(s.q.shape), s.expected)


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_attention_layer_applies_its_window_on_triton(triton_kernels: ModuleType, kv: str) -> None:
    case = TRITON_CASES["mixed"]
    s = _step(case, 6, QUANT[kv])
    attn = Attention(
        case.heads, case.dim, case.kv_heads, case.dim**-0.5, 0, sliding_window=case.window
    )
    attn.backend = "triton"
    torch.testing.assert_close(_forward(attn, s, DEVICE), s.expected, atol=1e-5, rtol=1e-4)


def test_attention_layer_window_arguments() -> None:
    assert Attention(4, 16, 2, 0.25, 0).sliding_window is None
    assert Attention(4, 16, 2, 0.25, 0, sliding_window=0).sliding_window is None
    assert Attention(4, 16, 2, 0.25, 0, sliding_window=512).sliding_window == 512
    with pytest.raises(ValueError, match="sliding_window"):
        Attention(4, 16, 2, 0.25, 0, sliding_window=-3)


def test_context_parallel_refuses_a_sliding_window() -> None:
    """Context parallelism attends the full context: a windowed layer refuses to run there."""
    case = MIXED["prompt"]
    s = _step(case)
    meta = dataclasses.replace(s.meta, context_parallel=cast(Any, object()))
    attn = Attention(case.heads, case.dim, case.kv_heads, 0.2, 0, sliding_window=case.window)
    tokens = s.q.shape[0]
    with pytest.raises(ValueError, match="not supported with prefill context parallelism"):
        attn(
            s.q.view(tokens, -1),
            s.k.view(tokens, -1),
            s.v.view(tokens, -1),
            ForwardContext(meta, [s.cache]),
        )
