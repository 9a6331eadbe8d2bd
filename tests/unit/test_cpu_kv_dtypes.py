"""The CPU paged attention (pagoda/kernels/cpu/paged_attention.cpp) over caches that are not
float32: bfloat16 and float16 (`--kv-cache-dtype bfloat16|float16`, or a bf16 model's own cache)
and int8 / float8 e4m3 with a scale per token and kv head (`--kv-cache-dtype int8|fp8`), read
from the cache as stored (kv_rows.h converts a work item's positions to float32).

The oracle is the kernel's own float32 path over the cache the torch path reads back
(layers/kv_cache.py:read_kv: exact conversions, code * scale in float32): the same bits, on
every instruction set, for decodes, mixed prefill steps, sliding windows and a latent cache; and
paged_attention_torch over the stored cache within the float32 path's tolerance."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.cpu import built
from pagoda.kernels.paged_cache import KVCache
from pagoda.layers.attention import paged_attention_torch
from pagoda.layers.kv_cache import dequantize_kv, quantize_kv
from pagoda.runner.step_inputs import build_attention_metadata

OPS = built()
pytestmark = pytest.mark.skipif(OPS is None, reason="the CPU kernels cannot be built here")
ISAS = [] if OPS is None else list(range(OPS.isa() + 1))
DTYPES = [torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn]
SCALED = (torch.int8, torch.float8_e4m3fn)


def _stored(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (float32) as the cache stores it in `dtype`: values, and scales where quantized."""
    if dtype in SCALED:
        return quantize_kv(x, dtype)
    return x.to(dtype), None


def _read_back(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """What the torch path reads: float32 (read_kv's conversion)."""
    return values.float() if scale is None else dequantize_kv(values, scale, torch.float32)


def _case(
    dtype: torch.dtype, lens: list[int], heads: int, kv_heads: int, dim: int, seed: int
) -> tuple[torch.Tensor, KVCache, KVCache, torch.Tensor, torch.Tensor]:
    """Queries, the stored cache, its float32 read-back, block tables (blocks scattered), lens."""
    gen = torch.Generator().manual_seed(seed)
    block_size = 16
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width + 3
    shape = (num_blocks, block_size, kv_heads, dim)
    k, k_scale = _stored(torch.randn(*shape, generator=gen) * 3, dtype)
    v, v_scale = _stored(torch.randn(*shape, generator=gen), dtype)
    stored = KVCache(k, v, k_scale, v_scale)
    plain = KVCache(_read_back(k, k_scale), _read_back(v, v_scale))
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, dim, generator=gen) * 2
    return (
        q,
        stored,
        plain,
        tables.to(torch.int32).contiguous(),
        torch.tensor(lens, dtype=torch.int32),
    )


def _decode(q: torch.Tensor, c: KVCache, tables, lens, isa: int, window: int = 0) -> torch.Tensor:
    assert OPS is not None
    return OPS.paged_decode_attention(
        q, c.k, c.v, tables, lens, 0.125, window, isa, 0, c.k_scale, c.v_scale
    )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("lens", "heads", "kv_heads", "dim"),
    [
        ([1, 255, 600], 9, 3, 64),  # SmolLM2's heads (the blocked path), a row past MAX_CHUNK
        ([70, 5], 12, 2, 128),  # Qwen2.5-1.5B's heads
        ([19, 3], 6, 3, 20),  # a width not a multiple of 8: the converters' scalar tails
    ],
)
def test_decode_over_a_stored_cache_is_the_float32_path_over_its_read_back(
    threads: int, isa: int, dtype: torch.dtype, lens: list[int], heads: int, kv_heads: int, dim: int
) -> None:
    q, stored, plain, tables, seq_lens = _case(dtype, lens, heads, kv_heads, dim, len(lens))
    out = _decode(q, stored, tables, seq_lens, isa)
    assert torch.equal(out, _decode(q, plain, tables, seq_lens, isa))
    for window in (1, 50):
        assert torch.equal(
            _decode(q, stored, tables, seq_lens, isa, window),
            _decode(q, plain, tables, seq_lens, isa, window),
        )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_mixed_step_over_a_stored_cache_matches_both_references(
    threads: int, isa: int, dtype: torch.dtype
) -> None:
    """Prefill chunks, a decode and verification rows: the float32 path's bits over the read-back
    cache, and paged_attention_torch over the stored one (which converts on read) within the
    float32 kernel's own tolerance."""
    assert OPS is not None
    q_lens, seq_lens = [40, 30, 1, 5, 300], [40, 330, 77, 190, 300]
    _, stored, plain, tables, lens = _case(dtype, seq_lens, 9, 3, 64, 11)
    q = torch.randn(sum(q_lens), 9, 64, generator=torch.Generator().manual_seed(12)) * 2
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)

    def run(c: KVCache, window: int) -> torch.Tensor:
        return OPS.paged_attention(
            q, c.k, c.v, tables, starts, lens, 0.125, window, isa, 0, c.k_scale, c.v_scale
        )

    for window in (0, 64):
        out = run(stored, window)
        assert torch.equal(out, run(plain, window)), window
    meta = build_attention_metadata(q_lens, seq_lens, tables.tolist(), 16)
    expected = paged_attention_torch(q, stored, meta, 0.125)
    torch.testing.assert_close(run(stored, 0), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8], ids=str)
def test_a_latent_cache_reads_its_values_from_the_stored_key_rows(
    isa: int, dtype: torch.dtype
) -> None:
    """Multi-head latent attention: one kv head of [latent, rotary key] rows, values the first
    value_dim of each, with the keys' scales; v is empty."""
    assert OPS is not None
    q, stored, plain, tables, lens = _case(dtype, [33, 300], 8, 1, 96, 21)
    empty = torch.empty(*stored.k.shape[:3], 0, dtype=dtype)
    out = OPS.paged_decode_attention(
        q, stored.k, empty, tables, lens, 0.1, 0, isa, 64, stored.k_scale, None
    )
    want = OPS.paged_decode_attention(
        q, plain.k, torch.empty(*plain.k.shape[:3], 0), tables, lens, 0.1, 0, isa, 64
    )
    assert out.shape == (2, 8, 64) and torch.equal(out, want)


def test_a_row_gets_the_same_bits_at_any_thread_count() -> None:
    assert OPS is not None
    q, stored, _, tables, lens = _case(torch.int8, [600, 17], 9, 3, 64, 31)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(_decode(q, stored, tables, lens, OPS.isa()))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_scales_come_with_a_quantized_cache_and_only_then() -> None:
    assert OPS is not None
    q, stored, plain, tables, lens = _case(torch.int8, [20], 4, 2, 32, 0)
    run = OPS.paged_decode_attention
    with pytest.raises(RuntimeError, match="only then"):
        run(q, stored.k, stored.v, tables, lens, 0.2, 0, 2, 0, None, None)
    with pytest.raises(RuntimeError, match="only then"):
        run(q, plain.k.bfloat16(), plain.v.bfloat16(), tables, lens, 0.2, 0, 2, 0,
            stored.k_scale, stored.v_scale)  # fmt: skip
    assert stored.k_scale is not None and stored.v_scale is not None
    with pytest.raises(RuntimeError, match="scales: float32"):
        run(
            q, stored.k, stored.v, tables, lens, 0.2, 0, 2, 0, stored.k_scale[:, :8], stored.v_scale
        )
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        run(q, plain.k.double(), plain.v.double(), tables, lens, 0.2, 0, 2)
    with pytest.raises(RuntimeError, match="the same dtype"):
        run(q, plain.k, plain.v.bfloat16(), tables, lens, 0.2, 0, 2)
