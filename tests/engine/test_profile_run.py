"""KV sizing by profiling (used on CUDA): the profile step runs on any device without touching
the engine's state, and the budget arithmetic leaves the weights and the activation peak free."""

from __future__ import annotations

from typing import Any

import torch

from pagoda import LLM, SamplingParams
from pagoda.runner.builder import kv_cache_budget


def test_profile_run_leaves_the_engine_unchanged(tiny_model_dir: Any) -> None:
    llm = LLM(tiny_model_dir("llama"), num_gpu_blocks_override=64, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 7, 9, 11]} for i in range(3)]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    caches = [[t.clone() for t in c.tensors()] for c in llm.engine.executor.runner.kv_caches]
    llm.engine.executor.runner.profile_run()  # 48 tokens: max_model_len 1024 -> one 48-token sequence
    for cache, saved in zip(llm.engine.executor.runner.kv_caches, caches):
        assert all(torch.equal(t, s) for t, s in zip(cache.tensors(), saved))
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert after == before


def test_kv_cache_budget() -> None:
    gib = 1 << 30
    # 80 GiB device, 0.9 of it ours; 3 GiB in use (weights, context), 2 GiB activation peak
    assert kv_cache_budget(80 * gib, 77 * gib, 2 * gib, 0.9) == int(72 * gib) - 5 * gib
    assert kv_cache_budget(80 * gib, 5 * gib, 2 * gib, 0.9) < 0  # nothing left: engine errors
