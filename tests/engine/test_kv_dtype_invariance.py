"""The determinism pagoda states (docs/determinism.md) over a KV cache that is not the model's
float32: `--kv-cache-dtype bfloat16` and `int8`, which pagoda's CPU attention reads as stored.
Batched and in 8-token chunks with prefix caching, every request gets the tokens it gets alone,
its logprobs within tests/equivalence.py's tolerance; on the tiny float32 Llama and on the
default path (the embedded SmolLM2 Q4_1 GGUF with the CPU kernels, where a last-bit difference
in any attention row would flip int8 activation codes and show far above the tolerance).

How close each cache stays to the float32 one is tests/unit/test_kv_quant.py's
test_engine_bf16_int8_and_fp8_greedy_agree_with_auto; the kernel's bits over each cache,
tests/unit/test_cpu_kv_dtypes.py's."""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from pagoda.kernels.cpu import kernels
from pagoda.outputs import RequestOutput
from tests.equivalence import assert_same_outputs


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(3)
    prefix = [rng.randrange(10, 1000) for _ in range(20)]
    return [prefix + [rng.randrange(10, 1000) for _ in range(rng.randint(3, 50))] for _ in range(n)]


PROMPTS = _prompts(8)
# even prompts greedy, odd ones seeded sampling; all with logprobs
PARAMS = [
    SamplingParams(
        max_tokens=16,
        ignore_eos=True,
        logprobs=2,
        **({"temperature": 0.8, "top_k": 40, "seed": i} if i % 2 else {"temperature": 0.0}),
    )
    for i in range(len(PROMPTS))
]


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module", params=["tiny-llama", "smollm2-gguf"])
def model(request: pytest.FixtureRequest) -> str:
    if kernels() is None:
        pytest.skip("pagoda's CPU kernels are not built: the torch path reads every cache")
    if request.param == "tiny-llama":
        return str(request.getfixturevalue("tiny_model_dir")("llama"))
    return str(request.getfixturevalue("smollm2_path"))


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_batched_and_chunked_equal_alone(model: str, kv_cache_dtype: str) -> None:
    alone_llm = LLM(
        model,
        kv_cache_dtype=kv_cache_dtype,
        enable_prefix_caching=False,
        num_gpu_blocks_override=256,
    )
    assert alone_llm.engine.executor.runner.kv_caches[0].k.dtype.itemsize <= 2
    alone = [_run(alone_llm, [p], [sp])[0] for p, sp in zip(PROMPTS, PARAMS)]
    batched = LLM(
        model,
        kv_cache_dtype=kv_cache_dtype,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
        num_gpu_blocks_override=256,
    )
    assert_same_outputs(_run(batched, PROMPTS, PARAMS), alone)
    assert batched.engine.stats().prefix_cache_hits > 0
