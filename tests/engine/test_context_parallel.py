"""Prefill context parallelism (layers/context_parallel.py, runner/context_parallel.py): two
worker processes of one thread each, over gloo, each holding half of every request's KV cache,
must give what one process gives.

- Greedy and seeded sampling: the same tokens as one process (logprobs within LOGPROB_ATOL), in
  mixed batches under chunked prefill and preemption, on the tiny Llama and (slow) Qwen3.
- A 4k-token prompt (two chunks of 2048), greedy with logprobs and prompt logprobs, equals one
  process; each rank's KV cache is half of one process's, its weights the whole model's.
- Which rows each rank computes and where their keys and values go: every position's K/V is
  written once, on rank position % N, into a distinct slot of that rank's half-size blocks.
- The partial attentions' log-sum-exp combination equals softmax attention over all the keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pagoda import LLM, SamplingParams
from pagoda.kernels.paged_cache import kv_cache_bytes
from pagoda.layers.context_parallel import combine_partials
from pagoda.layers.parallel import ContextParallel
from pagoda.model_config import ModelConfig
from pagoda.runner.context_parallel import context_metadata, rank_rows
from pagoda.runner.model_runner import ModelRunner
from pagoda.runner.step_inputs import build_attention_metadata
from tests.conftest import _randomize
from tests.engine.test_tensor_parallel import (
    ENGINE,
    PARAMS,
    PROMPTS,
    assert_gguf_keeps_one_rank_s_quality,
    assert_smollm2_float32_equals_one_process,
    kill_rank_1_mid_run,
)
from tests.equivalence import assert_same_outputs


def _run(llm: LLM) -> Any:
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)


def _kv_bytes(llm: LLM) -> int:
    runner = llm.engine.executor.runner
    assert isinstance(runner, ModelRunner)
    return kv_cache_bytes(runner.kv_caches)


# Qwen3 (explicit head_dim, q/k norms) is slow-marked for the default suite's time.
@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_pcp2_equals_one_process(tiny_weights_dir: Callable[[str], str], arch: str) -> None:
    folder = tiny_weights_dir(arch)
    one = LLM(folder, **ENGINE)
    want = _run(one)
    two = LLM(folder, prefill_context_parallel_size=2, **ENGINE)
    got = _run(two)
    assert_same_outputs(got, want)
    assert two.engine.stats().num_preemptions > 0  # the pool is small enough to preempt
    memory = two.engine.executor.memory()  # type: ignore[union-attr]
    assert [m["kv_cache_bytes"] for m in memory] == [_kv_bytes(one) // 2] * 2
    stats = two.engine.executor.stats()  # type: ignore[union-attr]
    assert all(s["context_calls"] > 0 for s in stats)
    two.engine.shutdown()


LONG_PROMPT = 4096


def _long_context_llama(folder: Path) -> str:
    """A tiny random Llama whose positions reach past a 4k-token prompt."""
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed=0)
    model.save_pretrained(folder)
    return str(folder)


def test_a_4k_token_prompt_equals_one_process(tmp_path: Path) -> None:
    """One 4096-token prompt, prefilled in two chunks of 2048 (the second attends the first's
    keys across both ranks), then 8 decode steps; prompt logprobs score every position."""
    folder = _long_context_llama(tmp_path)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 4096, (LONG_PROMPT,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, prompt_logprobs=1)
    engine = dict(skip_tokenizer_init=True, max_num_batched_tokens=2048, max_model_len=4200)
    engine["num_gpu_blocks_override"] = 300

    def run(llm: LLM) -> Any:
        return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)

    one = LLM(folder, **engine)
    want = run(one)
    two = LLM(folder, prefill_context_parallel_size=2, **engine)
    got = run(two)
    assert_same_outputs(got, want)
    assert len(got[0].prompt_logprobs) == LONG_PROMPT
    memory = two.engine.executor.memory()  # type: ignore[union-attr]
    runner = one.engine.executor.runner
    assert isinstance(runner, ModelRunner)
    assert [m["kv_cache_bytes"] for m in memory] == [_kv_bytes(one) // 2] * 2
    assert [m["weight_bytes"] for m in memory] == [runner.model_config.weight_bytes] * 2
    two.engine.shutdown()


def test_rows_and_slots_of_each_rank() -> None:
    """A step of a decode (seq 11), a first chunk (positions 0-5) and a later chunk (positions
    5-9 after cached context), blocks of 4: each prefill row is computed on one rank, each
    decode row on both, and every new position's K/V lands once, in its owner's half-blocks."""
    query_lens, seq_lens = [1, 6, 5], [11, 6, 10]
    tables = [[0, 1, 2], [3, 4], [5, 6, 7]]
    block_size, size = 4, 2
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    positions = torch.tensor([10, *range(6), *range(5, 10)])
    rows = rank_rows(query_lens, seq_lens, ContextParallel(0, size))
    # position p of a prefill is on rank p % 2; the decode row (flat row 0) on both
    assert rows == [[0, 1, 3, 5, 8, 10], [0, 2, 4, 6, 7, 9, 11]]
    written: dict[tuple[int, int], int] = {}
    for rank in range(size):
        cpm = context_metadata(meta, positions, ContextParallel(rank, size), block_size)
        assert cpm.local_rows.tolist() == rows[rank]
        flat = cpm.local_rows[cpm.write_rows]
        assert (positions[flat] % size == rank).all()
        for row, slot in zip(flat.tolist(), cpm.write_slots.tolist(), strict=True):
            assert (rank, slot) not in written
            written[(rank, slot)] = row
            block, offset = divmod(int(meta.slot_mapping[row]), block_size)
            assert slot == block * (block_size // size) + offset // size
        assert cpm.decode_rows.tolist() == [0]
        assert [p.seq_len for p in cpm.prefills] == [6, 10]
        for p in cpm.prefills:
            rows_of_p = cpm.local_rows[p.local_start : p.local_end]
            assert positions[rows_of_p].tolist() == list(range(p.first_position, p.seq_len, size))
            assert p.shard_len == len(p.block_ids) * block_size // size
    assert sorted(written.values()) == list(range(12))  # every new row's K/V written once


class _GatheredRanks(ContextParallel):
    """Stands in for the group in one process: all_gather returns the ranks' tensors, given."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        super().__init__(0, len(parts))
        object.__setattr__(self, "parts", parts)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.parts  # type: ignore[attr-defined,no-any-return]


def test_partial_attentions_combine_to_the_whole() -> None:
    """Split 13 keys over 3 'ranks' (one holding none of a row's keys: lse -inf): the combined
    output is softmax attention over all of them, to float32 rounding."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, generator=gen)
    k = torch.randn(2, 13, 4, 8, generator=gen)
    v = torch.randn(2, 13, 4, 8, generator=gen)
    scores = torch.einsum("bhd,bmhd->bhm", q, k) / math.sqrt(8)
    want = torch.einsum("bhm,bmhd->bhd", scores.softmax(-1), v)
    shards = [range(0, 6), range(6, 13), range(0, 0)]
    partials, lses = [], []
    for keys in shards:
        s = scores[..., keys.start : keys.stop]
        lse = torch.logsumexp(s, -1) if len(keys) else torch.full((2, 4), -math.inf)
        p = torch.exp(s - lse.unsqueeze(-1))
        partials.append(torch.einsum("bhm,bmhd->bhd", p, v[:, keys.start : keys.stop]))
        lses.append(lse)
    packed = [torch.cat([o, lse.unsqueeze(-1)], -1) for o, lse in zip(partials, lses)]
    got = combine_partials(partials[0], lses[0], _GatheredRanks(packed))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"tensor_parallel_size": 2}, "with tensor or pipeline parallelism"),
        ({"block_size": 8, "prefill_context_parallel_size": 3}, "must divide the block size"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
        ({"async_scheduling": True}, "synchronous scheduling"),
        ({"prefill_context_parallel_size": 0}, "prefill_context_parallel_size must be >= 1"),
    ],
)
def test_unsupported_combinations_are_value_errors(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(**{"prefill_context_parallel_size": 2, **extra})


def test_blocks_are_counted_in_a_rank_s_bytes_per_token() -> None:
    """The engine sizes its pool with a rank's KV bytes per token: half under two ranks, so the
    same memory holds twice the blocks."""
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    one = ModelConfig(hf, "LlamaForCausalLM", "float32", 64)
    two = ModelConfig(hf, "LlamaForCausalLM", "float32", 64, prefill_context_parallel_size=2)
    assert two.kv_bytes_per_token() * 2 == one.kv_bytes_per_token()
    assert two.kv_bytes_per_token("int8") * 2 == one.kv_bytes_per_token("int8")


# The default suite kills a tensor-parallel rank under `pagoda serve`: the same WorkerGroup path.
@pytest.mark.slow
def test_a_killed_rank_fails_loudly(tiny_weights_dir: Callable[[str], str]) -> None:
    llm = LLM(tiny_weights_dir("llama"), prefill_context_parallel_size=2, skip_tokenizer_init=True)
    kill_rank_1_mid_run(llm, "context-parallel rank 1 .* died with exit code -9")
    with pytest.raises(RuntimeError, match="context-parallel rank 1"):
        llm.engine.check_health()
    llm.engine.shutdown()


@pytest.mark.slow
def test_smollm2_float32_pcp2_equals_one_process(smollm2_llm: LLM) -> None:
    assert_smollm2_float32_equals_one_process(smollm2_llm, prefill_context_parallel_size=2)


@pytest.mark.slow
def test_smollm2_gguf_pcp2_keeps_one_rank_s_quality(
    smollm2_path: str, smollm2_tokenizer: Any
) -> None:
    """Context parallelism merges each row's attention over the ranks' positions (torch's SDPA
    on each rank's keys, then the partials combined), another rounding than one rank's, and one
    that follows the batch (docs/determinism.md): held to one rank's quality
    (tests/engine/test_tensor_parallel.py states the bounds)."""
    assert_gguf_keeps_one_rank_s_quality(
        smollm2_path, smollm2_tokenizer, own_bits=False, prefill_context_parallel_size=2
    )
