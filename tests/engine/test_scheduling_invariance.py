"""The same greedy tokens whatever the scheduling: prefix caching, chunk size, preemption, batch."""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _prompts(n: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 1000) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(10, 1000) for _ in range(rng.randint(3, 60))] for _ in range(n)]


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(tiny_llama: str) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt alone, no prefix caching, a roomy pool: the baseline everything must equal."""
    llm = LLM(tiny_llama, enable_prefix_caching=False, num_gpu_blocks_override=512)
    prompts = _prompts(16, shared_prefix=24)
    return prompts, [_run(llm, [p])[0] for p in prompts]


def test_batch_of_16_equals_alone(tiny_llama: str, reference) -> None:
    prompts, expected = reference
    llm = LLM(tiny_llama, enable_prefix_caching=False, num_gpu_blocks_override=512)
    assert _run(llm, prompts) == expected


def test_prefix_caching_gives_same_tokens_and_hits(tiny_llama: str, reference) -> None:
    prompts, expected = reference
    llm = LLM(tiny_llama, enable_prefix_caching=True, num_gpu_blocks_override=512)
    assert _run(llm, prompts[:1]) == expected[:1]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # The 24-token shared prefix holds one full 16-token block; the first prompt's blocks hit.
    assert outs[0].num_cached_tokens >= 16
    assert all(o.num_cached_tokens >= 16 for o in outs)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries > stats.prefix_cache_hits


def test_tiny_token_budget_many_chunks(tiny_llama: str, reference) -> None:
    prompts, expected = reference
    llm = LLM(tiny_llama, max_num_batched_tokens=8, num_gpu_blocks_override=512)
    assert _run(llm, prompts) == expected


def test_small_pool_forces_preemption(tiny_llama: str, reference) -> None:
    prompts, expected = reference
    # 16 requests of up to ~104 tokens (7 blocks each) cannot all fit in 24 blocks.
    llm = LLM(tiny_llama, num_gpu_blocks_override=24, enable_prefix_caching=True)
    assert _run(llm, prompts) == expected
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.kv_cache_manager.pool.num_free_blocks == 24


def test_smollm2_scheduling_invariance(smollm2_llm: LLM) -> None:
    tok = smollm2_llm.get_tokenizer()
    texts = [
        "The history of the Roman empire",
        "A short poem about autumn leaves:",
        "import numpy as np\nx = np.",
        "The three primary colors are",
    ]
    prompts = [tok.encode(t) for t in texts]
    alone = [_run(smollm2_llm, [p])[0] for p in prompts]
    assert _run(smollm2_llm, prompts) == alone  # prefix cache now warm, batched
    chunked = LLM(
        None,
        quantization="none",  # as smollm2_llm: the same weights and kernels, other schedules
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
        num_gpu_blocks_override=64,
    )
    assert _run(chunked, prompts) == alone
