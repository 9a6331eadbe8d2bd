"""Triton paged attention (pagoda/kernels/attention.py) against the torch reference
`paged_attention_torch`, under the Triton interpreter when there is no GPU.

Every case fills the whole cache with junk (finite, mean 4) first, then writes each sequence's
keys and values at positions [0, seq_len) through shuffled, non-contiguous block ids. The kernels
get the metadata's block tables as views of wider buffers (row stride > width) whose entries past
a sequence's pages name junk blocks: junk that leaks into a kernel shows up as a mismatch.

Tolerances: float32 atol 1e-5, rtol 1e-4 (the same math up to summation order and exp2; ieee
dots); bfloat16 / float16 atol = rtol = 2e-2 (P and the output rounded to 16 bits).

Triton 3.8's interpreter multiplies the raw bit patterns of bfloat16 operands in tl.dot
(triton-lang/triton#11584, "not supported yet") and casts float32 -> bfloat16 by truncation. Under
the interpreter both are replaced, for this module, by what a GPU computes: bfloat16 operands
widened exactly to float32, casts rounded to nearest even. The kernels are unchanged.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.triton_interpreter import check_interpreted, interpreter_as_gpu  # noqa: E402, F401

check_interpreted()
pytestmark = pytest.mark.usefixtures("interpreter_as_gpu")

from pagoda.kernels.attention import (  # noqa: E402
    decode_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
)
from pagoda.kernels.paged_cache import KVCache  # noqa: E402
from pagoda.layers.attention import paged_attention_torch, write_kv_cache  # noqa: E402
from pagoda.layers.forward_context import AttentionMetadata  # noqa: E402
from pagoda.runner.step_inputs import build_attention_metadata  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-2, 2e-2)}
DTYPES = list(TOL)
FP8 = torch.float8_e4m3fn
JUNK_BLOCKS = 3  # blocks no sequence owns, filled with junk; table padding points at them


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _junk_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    quant: torch.dtype | None,
) -> KVCache:
    cache = KVCache.allocate(num_blocks, block_size, num_kv_heads, head_dim, dtype, quant, DEVICE)
    for t in (cache.k, cache.v):
        junk = torch.randn(t.shape, device=DEVICE) * 3 + 4
        if quant == torch.int8:
            junk = junk.mul(20).round().clamp(-127, 127)
        t.copy_(junk.to(t.dtype))
    for s in (cache.k_scale, cache.v_scale):
        if s is not None:
            s.uniform_(0.5, 2.0)
    return cache


def _junk_padded(
    tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, junk_ids: list[int]
) -> torch.Tensor:
    """`tables` with every entry past a row's pages naming a junk block, one column wider, as a
    view of a buffer wider still (row stride > width)."""
    rows, width = tables.shape
    ids = torch.tensor(junk_ids, dtype=torch.int32, device=DEVICE)
    buf = ids[torch.randint(len(junk_ids), (rows, width + 3), device=DEVICE)]
    pages = (seq_lens.long() + block_size - 1) // block_size
    keep = torch.arange(width, device=DEVICE)[None, :] < pages[:, None]
    buf[:, :width] = torch.where(keep, tables, buf[:, :width])
    return buf[:, : width + 1]


def _check(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    dtype: torch.dtype = torch.float32,
    quant: torch.dtype | None = None,
    block_size: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    num_splits: int = 2,
    q_stride_pad: int = 0,
) -> None:
    """Run both kernels over one mixed batch and compare every output row with the reference."""
    torch.manual_seed(0)
    pages = [_cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(pages) + JUNK_BLOCKS
    perm = torch.randperm(num_blocks).tolist()
    tables = [perm[sum(pages[:i]) : sum(pages[: i + 1])] for i in range(len(pages))]
    junk_ids = perm[sum(pages) :]
    cache = _junk_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, quant)
    slots = [t[p // block_size] * block_size + p % block_size for t, s in zip(tables, seq_lens) for p in range(s)]  # fmt: skip
    k = torch.randn(len(slots), num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
    write_kv_cache(k, torch.randn_like(k), cache, torch.tensor(slots, device=DEVICE))

    num_tokens = sum(query_lens)
    # q as a column slice of wider rows (a fused qkv projection) when q_stride_pad > 0.
    width = num_heads * head_dim
    q_rows = torch.randn(num_tokens, width + q_stride_pad, device=DEVICE, dtype=dtype)
    q = q_rows[:, :width].view(num_tokens, num_heads, head_dim)
    scale = head_dim**-0.5
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size, DEVICE)
    expected = paged_attention_torch(q, cache, meta, scale)

    out = torch.full_like(q, float("nan"))  # every row must be written
    _run_kernels(q, out, cache, meta, scale, num_splits, junk_ids)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


def _run_kernels(
    q: torch.Tensor,
    out: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int,
    junk_ids: list[int],
) -> None:
    block_size = cache.k.shape[1]
    d_tables = _junk_padded(meta.decode_block_tables, meta.decode_seq_lens, block_size, junk_ids)
    p_tables = _junk_padded(meta.prefill_block_tables, meta.prefill_seq_lens, block_size, junk_ids)
    paged_decode_attention(
        q, out, cache, meta.decode_token_idx, d_tables, meta.decode_seq_lens, scale, num_splits
    )
    paged_prefill_attention(
        q,
        out,
        cache,
        meta.prefill_token_start,
        meta.prefill_query_lens,
        meta.prefill_seq_lens,
        p_tables,
        meta.max_prefill_query_len,
        scale,
    )


def _mixed_batch(bs: int) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens): prefills fresh, after cached context, longer than one 64-row tile
    and exactly one block, interleaved with decodes of length 1, at block boundaries, one past
    a boundary, and long."""
    batch = [
        (7, 7),
        (1, 1),
        (5, 2 * bs + 5),
        (1, 2 * bs),
        (70, 73),
        (1, bs + 1),
        (2, 2),
        (1, 37),
        (bs, bs) if bs > 1 else (3, 3),
        (1, bs),
    ]
    return [q for q, _ in batch], [s for _, s in batch]


HEADS = [(4, 4), (4, 2), (8, 2), (6, 2)]  # GQA group sizes 1, 2, 4 and 3 (padded head rows)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_batch(block_size: int, heads: tuple[int, int]) -> None:
    query_lens, seq_lens = _mixed_batch(block_size)
    _check(query_lens, seq_lens, block_size=block_size, num_heads=heads[0], num_kv_heads=heads[1])


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision(dtype: torch.dtype, block_size: int) -> None:
    query_lens, seq_lens = _mixed_batch(block_size)
    _check(query_lens, seq_lens, dtype=dtype, block_size=block_size, num_heads=6, num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 9])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_splits(block_size: int, num_splits: int) -> None:
    # At most 7 pages: 5 splits of 7 pages leave the last split empty; 9 splits leave >= 2 empty.
    seq_lens = [1, block_size, 3 * block_size, 3 * block_size + 1, 7 * block_size - 1]
    _check([1] * len(seq_lens), seq_lens, block_size=block_size, num_splits=num_splits)


@pytest.mark.parametrize("head_dim", [48, 80])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_dim_not_power_of_two(dtype: torch.dtype, head_dim: int) -> None:
    _check([9, 1, 1, 4], [9, 17, 8, 12], dtype=dtype, head_dim=head_dim, num_splits=3)


@pytest.mark.parametrize("quant", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantized_cache(dtype: torch.dtype, quant: torch.dtype) -> None:
    # Dequantized as the reference does (values.float() * scale -> query dtype): same tolerances.
    _check([6, 1, 1, 3], [6, 13, 1, 11], dtype=dtype, quant=quant, num_heads=6, num_splits=2)


@pytest.mark.parametrize("store", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_cache_under_a_float32_model(store: torch.dtype) -> None:
    # --kv-cache-dtype bfloat16|float16 under float32 queries: the rows widen exactly on load and
    # the math stays float32 (ieee dots), as the reference's read_kv: float32's tolerances.
    _check([6, 1, 1, 3], [6, 13, 1, 11], quant=store, num_heads=6, num_splits=2)


def test_strided_q() -> None:
    _check([5, 1, 1], [9, 4, 16], q_stride_pad=2 * 64, num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_padding_row(num_splits: int) -> None:
    """A row with seq_len 0 gets zeros and reads nothing; rows not in token_idx stay untouched."""
    torch.manual_seed(0)
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 64
    cache = _junk_cache(8, block_size, num_kv_heads, head_dim, torch.float32, None)
    seq_lens = [5, 11]
    tables = [[3, 6], [1, 7, 2]]
    q = torch.randn(4, num_heads, head_dim, device=DEVICE)
    meta = build_attention_metadata([1, 1], seq_lens, tables, block_size, DEVICE)
    expected = paged_attention_torch(q[:2], cache, meta, 0.125)

    # Rows 0, 1: real decodes; row 3: padding (junk block ids, seq_len 0); row 2: not a decode.
    out = torch.full_like(q, 7.0)
    token_idx = torch.tensor([0, 1, 3], dtype=torch.int64, device=DEVICE)
    block_tables = torch.tensor([[3, 6, 0], [1, 7, 2], [5, 5, 5]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens + [0], dtype=torch.int32, device=DEVICE)
    paged_decode_attention(q, out, cache, token_idx, block_tables, lens, 0.125, num_splits)

    torch.testing.assert_close(out[:2], expected, atol=1e-5, rtol=1e-4)
    assert torch.equal(out[2], torch.full_like(out[2], 7.0))
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_decode_num_splits_rule() -> None:
    assert decode_num_splits(1, 8, 100) == 32  # cdiv(264, 8) = 33, capped at 32
    assert decode_num_splits(4, 8, 100) == 9  # cdiv(264, 32)
    assert decode_num_splits(1, 2, 5) == 5  # never more splits than table columns
    assert decode_num_splits(256, 8, 100) == 1  # the batch alone fills the GPU
    assert decode_num_splits(64, 2, 0) == 1
