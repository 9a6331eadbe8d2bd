"""The triton backend's warm-up (ModelRunner.warm_up_kernels) makes every kernel variant that
serving needs: after the engine starts, a run of chunked prompts mixed with decodes, decode
batches of every size and block tables of every width launches no Triton kernel whose
specialization key (what the JIT compiles once per, tests/triton_variants.py) is new.

The kernels' own checks: a quantized matmul over every row count, and decode attention over
every block-table width and split count, launch only the variants of the warm-up's sizes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from tests.triton_interpreter import check_interpreted  # noqa: E402
from tests.triton_variants import kernel_variants  # noqa: E402

check_interpreted()

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.kernels import attention  # noqa: E402
from pagoda.kernels.quant_matmul import GEMM_MAX_M, w8a16_matmul  # noqa: E402
from pagoda.runner.kernel_warmup import decode_split_counts, matmul_row_counts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_no_kernel_variant_after_warm_up(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fewer stage-1 programs per step than an H100's, so that a few requests span every split
    # variant: 4 splits (1 request), 2 (2 or 3), 1 (4 or more: direct).
    monkeypatch.setattr(attention, "_TARGET_PROGRAMS", 8)
    with kernel_variants(monkeypatch) as variants:
        llm = LLM(
            tiny_model_dir("qwen3"),
            quantization="none",
            attention_backend="triton",
            num_gpu_blocks_override=64,
            block_size=2,  # block tables of widths 1 (== 1), 16 (% 16) and others
            max_num_seqs=5,
            max_num_batched_tokens=12,  # prompts arrive in chunks beside decodes
            max_model_len=40,
        )
        warmed = variants.snapshot()
        assert {"_decode_stage1_kernel", "_decode_stage2_kernel", "_prefill_kernel"} <= set(warmed)
        lens_out = [(1, 6), (3, 4), (7, 5), (12, 3), (30, 3)]
        prompts = [
            {"prompt_token_ids": [(7 * n + j) % 900 + 3 for j in range(n)]} for n, _ in lens_out
        ]
        params = [
            SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in lens_out
        ]
        llm.generate(prompts, params, use_tqdm=False)
        assert variants.new_since(warmed) == {}


def test_quant_matmul_rows_reuse_the_warm_up_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = 64, 128
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=DEVICE)
    scale = torch.rand(n, 4, device=DEVICE)
    last = GEMM_MAX_M + 8
    with kernel_variants(monkeypatch) as variants:
        for m in matmul_row_counts(1, last):
            w8a16_matmul(torch.randn(m, k, device=DEVICE), weight, scale, 32)
        warmed = variants.snapshot()
        for m in range(1, last + 1):
            w8a16_matmul(torch.randn(m, k, device=DEVICE), weight, scale, 32)
        assert variants.new_since(warmed) == {}


def test_decode_attention_reuses_the_warm_up_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.kernels.paged_cache import KVCache

    monkeypatch.setattr(attention, "_TARGET_PROGRAMS", 16)  # 8, 4, 3, 2, 2, 2, 2, 1 splits
    num_kv_heads, max_blocks, block_size = 2, 40, 4
    cache = KVCache.allocate(64, block_size, num_kv_heads, 16, torch.float32, None, DEVICE)
    q = torch.randn(8, 4, 16, device=DEVICE)
    out = torch.empty_like(q)

    def decode(batch: int, width: int, splits: int) -> None:
        tables = torch.arange(batch * width, dtype=torch.int32, device=DEVICE) % 64
        token_idx = torch.arange(batch, device=DEVICE)
        seq_lens = torch.ones(batch, dtype=torch.int32, device=DEVICE)  # one page read
        tables = tables.view(batch, width)
        attention.paged_decode_attention(q, out, cache, token_idx, tables, seq_lens, 1.0, splits)

    def splits_of(batch: int) -> int:
        return attention.decode_num_splits(batch, num_kv_heads, max_blocks)

    with kernel_variants(monkeypatch) as variants:
        for splits in decode_split_counts(8, splits_of):
            decode(1, 2, splits)
        warmed = variants.snapshot()
        for batch in (1, 2, 3, 4, 8):
            for width in (1, 5, 16):
                decode(batch, width, splits_of(batch))
        assert variants.new_since(warmed) == {}
