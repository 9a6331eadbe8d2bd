"""The GPU fast path end to end (skipped without CUDA): SmolLM2 in bf16 with the triton kernels,
decode batches replayed from CUDA graphs, against the eager runs and HF transformers in bf16."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.oracle import assert_greedy_match, hf_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "List three colors:",
    "The quick brown fox",
    "Water boils at a temperature of",
    "In 1492, Christopher Columbus",
    "Machine learning is a field of study that",
]
MAX_TOKENS = 32


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _llm(**kwargs: Any) -> LLM:
    return LLM(
        None,
        device="cuda",
        dtype="bfloat16",
        quantization="none",
        max_model_len=1024,
        max_num_seqs=16,
        kv_cache_memory_bytes=1 << 30,
        **kwargs,
    )


def _run(llm: LLM, prompt_ids: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], _greedy(max_tokens))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    llm = _llm(enforce_eager=True)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    del llm
    return ids


@pytest.fixture(scope="module")
def runs(prompt_ids: list[list[int]]) -> Iterator[dict[str, list[list[int]]]]:
    """Greedy tokens of each configuration, one engine alive at a time."""
    out: dict[str, list[list[int]]] = {}
    configs = {
        "graphs": dict(attention_backend="triton"),
        "triton_eager": dict(attention_backend="triton", enforce_eager=True),
        "torch_eager": dict(attention_backend="torch", enforce_eager=True),
    }
    for name, kwargs in configs.items():
        llm = _llm(**kwargs)
        if name == "graphs":
            assert llm.engine.runner.graphs is not None
        out[name] = _run(llm, prompt_ids)
        out[name + "_5"] = _run(llm, prompt_ids[:5])  # decode batches of 5 replay size 8
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    yield out


def test_graph_replay_equals_eager(runs: dict[str, list[list[int]]]) -> None:
    # 8 requests finish together: every decode step is a batch of 8, a captured size, so the
    # replay runs the same kernels on the same shapes as the eager step.
    assert runs["graphs"] == runs["triton_eager"]


@pytest.fixture(scope="module")
def hf_bf16(smollm2_path: str) -> Any:
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    return model.to("cuda").eval()


@pytest.mark.parametrize("name", ["graphs", "graphs_5", "triton_eager", "torch_eager"])
def test_gpu_paths_match_hf_bf16(
    name: str, runs: dict[str, list[list[int]]], prompt_ids: list[list[int]], hf_bf16: Any
) -> None:
    ids = prompt_ids[:5] if name.endswith("_5") else prompt_ids
    expected = hf_greedy(hf_bf16, ids, MAX_TOKENS)
    for tokens, (hf_tokens, hf_logprobs) in zip(runs[name], expected):
        assert_greedy_match(tokens, hf_tokens, hf_logprobs)
