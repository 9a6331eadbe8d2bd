"""--runner pooling against HF transformers: each prompt's vector equals the model's final hidden
states pooled as the checkpoint (or --pooler-config) says: cosine >= 0.9999 per input, on tiny
random Qwen3 and Llama checkpoints, with prompts split over several steps (chunked prefill),
batched together, and (LAST pooling) sharing the prefix cache."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagoda import LLM, PoolingParams, SamplingParams
from tests.pooling_reference import (
    check_close,
    hf_vectors,
    sentence_transformers_files,
    with_files,
)

# Long enough that a 16-token budget splits each one over several steps.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, then runs far away into the forest.",
    "Paged attention keeps the KV cache in blocks.",
    "A",
    "Embeddings map text to vectors; similar texts land close together in that space.",
]
SHARED = "You are a retrieval assistant. Represent this passage for searching: " * 3
CHUNKED = dict(max_num_batched_tokens=16, num_gpu_blocks_override=128)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_last_token_pooling_matches_hf_and_shares_the_prefix_cache(
    arch: str,
    tiny_model_dir: Callable[[str], str],
    tiny_hf_model: Callable[[str], torch.nn.Module],
    smollm2_tokenizer: Any,
) -> None:
    # No sentence-transformers files: vLLM's default for a causal LM, LAST and normalized.
    llm = LLM(tiny_model_dir(arch), runner="pooling", **CHUNKED)
    hf = tiny_hf_model(arch)
    outs = llm.embed(PROMPTS, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [smollm2_tokenizer.encode(p) for p in PROMPTS]
    check_close(
        [o.outputs.embedding for o in outs],
        hf_vectors(hf, smollm2_tokenizer, PROMPTS, "LAST", True),
    )

    shared = [SHARED + "cats", SHARED + "dogs"]
    first = llm.embed(shared[0], use_tqdm=False)[0]
    second = llm.embed(shared[1], use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    block = llm.config.cache.block_size
    common = len(smollm2_tokenizer.encode(SHARED))
    assert second.num_cached_tokens == common // block * block > 0
    want = hf_vectors(hf, smollm2_tokenizer, shared, "LAST", True)
    check_close([first.outputs.embedding, second.outputs.embedding], want)


@pytest.mark.parametrize(
    ("arch", "mode", "pooling"),
    [("llama", "pooling_mode_mean_tokens", "MEAN"), ("qwen3", "pooling_mode_cls_token", "CLS")],
)
def test_the_checkpoints_sentence_transformers_pooling_is_read(
    arch: str,
    mode: str,
    pooling: str,
    tmp_path: Path,
    tiny_model_dir: Callable[[str], str],
    tiny_hf_model: Callable[[str], torch.nn.Module],
    smollm2_tokenizer: Any,
) -> None:
    folder = with_files(
        tiny_model_dir(arch), tmp_path / "st", sentence_transformers_files(mode, False)
    )
    llm = LLM(folder, runner="pooling", **CHUNKED)
    assert llm.engine.model_config.pooler is not None
    assert llm.engine.model_config.pooler.pooling_type == pooling
    assert llm.engine.kv_cache_manager.enable_caching is False  # every row is read
    outs = llm.embed(PROMPTS, use_tqdm=False)
    want = hf_vectors(tiny_hf_model(arch), smollm2_tokenizer, PROMPTS, pooling, False)
    check_close([o.outputs.embedding for o in outs], want)
    # a request may normalize what the checkpoint does not
    unit = llm.embed(PROMPTS[0], PoolingParams(normalize=True), use_tqdm=False)[0]
    check_close(
        [unit.outputs.embedding],
        hf_vectors(tiny_hf_model(arch), smollm2_tokenizer, PROMPTS[:1], pooling, True),
    )


def test_pooler_config_overrides_the_checkpoint_and_dimensions_cut_matryoshka_vectors(
    tmp_path: Path,
    tiny_model_dir: Callable[[str], str],
    tiny_hf_model: Callable[[str], torch.nn.Module],
    smollm2_tokenizer: Any,
) -> None:
    src = tiny_model_dir("qwen3")
    config = json.loads((Path(src) / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32, 64]
    files = {**sentence_transformers_files("pooling_mode_lasttoken", True), "config.json": config}
    folder = with_files(src, tmp_path / "m", files)
    llm = LLM(folder, runner="pooling", pooler_config={"pooling_type": "mean"}, **CHUNKED)
    hf = tiny_hf_model("qwen3")
    cut = llm.embed(PROMPTS, PoolingParams(dimensions=16), use_tqdm=False)
    raw = hf_vectors(hf, smollm2_tokenizer, PROMPTS, "MEAN", False)
    want = [v[:16] / np.linalg.norm(v[:16]) for v in raw]  # cut, then normalized
    assert all(o.outputs.hidden_size == 16 for o in cut)
    check_close([o.outputs.embedding for o in cut], want)
    with pytest.raises(ValueError, match=r"dimensions must be one of \[16, 32, 64\]"):
        llm.embed("x", PoolingParams(dimensions=8), use_tqdm=False)


def test_wrong_calls_for_the_runner_are_value_errors(tiny_model_dir: Callable[[str], str]) -> None:
    pooling = LLM(tiny_model_dir("llama"), runner="pooling", num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="--runner pooling"):
        pooling.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        pooling.embed("hi", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be an int >= 1"):
        PoolingParams(dimensions=0)
    generating = LLM(tiny_model_dir("llama"), num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="embeddings need"):
        generating.embed("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        LLM(tiny_model_dir("llama"), runner="pooling", pooler_config={"pooling_type": "max"})
    with pytest.raises(ValueError, match="drop --speculative-config"):
        LLM(
            tiny_model_dir("llama"),
            runner="pooling",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )


def test_async_scheduling_pools_the_same_vectors(tiny_model_dir: Callable[[str], str]) -> None:
    """Async scheduling (on by default on CUDA): a pooling request is not scheduled again while
    the step that ends its prompt is in flight, and the vectors are the synchronous engine's."""
    prompts = [*PROMPTS, SHARED + "birds"]
    got = {}
    for async_scheduling in (False, True):
        llm = LLM(
            tiny_model_dir("qwen3"), runner="pooling", async_scheduling=async_scheduling, **CHUNKED
        )
        got[async_scheduling] = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
    assert got[True] == got[False]


def test_an_input_may_fill_the_context_and_not_pass_it(
    tiny_model_dir: Callable[[str], str],
    tiny_hf_model: Callable[[str], torch.nn.Module],
) -> None:
    """A pooling request samples nothing, so its prompt may be max_model_len tokens (vLLM's
    rule), not one more."""
    llm = LLM(tiny_model_dir("llama"), runner="pooling", max_model_len=48, **CHUNKED)
    ids = [(7 * i) % 1000 + 5 for i in range(48)]
    out = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0]
    with torch.no_grad():
        hidden = tiny_hf_model("llama").model(torch.tensor([ids])).last_hidden_state[0, -1]
    check_close([out.outputs.embedding], [torch.nn.functional.normalize(hidden, dim=-1).numpy()])
    with pytest.raises(ValueError, match="maximum context length is 48 tokens"):
        llm.embed({"prompt_token_ids": [*ids, 5]}, use_tqdm=False)
