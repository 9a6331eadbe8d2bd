"""Pipeline parallelism (layers/parallel.PipelineStage, runner/pipeline.py): two stages of one
thread each, over gloo, must give what one process gives.

- Greedy and seeded sampling: the same tokens as pipeline_parallel_size 1 (logprobs within
  LOGPROB_ATOL), in mixed batches under chunked prefill and preemption, on the tiny Llama (3
  layers: stages of 2 + 1), Qwen2 and Qwen3 (tied embeddings: the last stage's head reads the
  embedding's matrix itself); SmolLM2 (slow); with tensor parallelism in each stage (slow).
- Each stage holds its layers' weights and KV cache only.
- Steps of several requests run as two micro-batches that overlap: the first stage sends one
  micro-batch on and computes the next while the last stage computes the first, read off the
  stages' timestamps.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from pagoda import LLM, SamplingParams
from pagoda.kernels.paged_cache import kv_cache_bytes
from pagoda.layers.parallel import PipelineStage
from pagoda.layers.quant_forms import stored_bytes
from pagoda.outputs import RequestOutput
from pagoda.runner.model_runner import ModelRunner
from pagoda.runner.pipeline import micro_batches
from tests.engine.test_tensor_parallel import ENGINE, PARAMS, PROMPTS, kill_rank_1_mid_run
from tests.equivalence import assert_same_outputs


def _run(llm: LLM) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)


# Qwen2 (tied like Qwen3, with q/k/v biases) is slow-marked to keep the default suite's time.
@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow), "qwen3"])
def test_pp2_equals_one_process(tiny_weights_dir: Callable[[str], str], arch: str) -> None:
    folder = tiny_weights_dir(arch)
    one = LLM(folder, **ENGINE)
    want = _run(one)
    two = LLM(folder, pipeline_parallel_size=2, **ENGINE)
    got = _run(two)
    assert_same_outputs(got, want)
    assert two.engine.stats().num_preemptions > 0  # the pool is small enough to preempt
    _assert_stages_hold_their_layers(one, two)
    stats = two.engine.executor.stats()  # type: ignore[union-attr]
    # every step of the first stage sent one stream per micro-batch; some steps had two
    assert stats[0]["pipeline_calls"] > stats[0]["steps"]
    assert stats[1]["pipeline_calls"] == stats[0]["pipeline_calls"]  # each received
    two.engine.shutdown()


def test_the_stages_compute_micro_batches_side_by_side(
    tiny_weights_dir: Callable[[str], str],
) -> None:
    """Stage 0 computes micro-batch k + 1 while stage 1 computes micro-batch k: their spans
    (runner/pipeline.StageTimeline: from a stage's input arriving to its output, on the clock
    the machine's processes share) overlap. A pipeline that waited for the last stage before
    going on would show none.

    The spans are long (two prefill micro-batches of 4 x 1,000 tokens, 50 to 100 ms each), so
    that the overlap holds on a loaded machine too: stage 0's next micro-batch is runnable the
    moment it sent the last one, and the OS scheduler runs every runnable process within a few
    milliseconds even on one free core. (With 10 ms spans, a run on a loaded 2-core machine
    once showed no overlap in any step.)"""
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 1000) for _ in range(1000)] for _ in range(8)]
    llm = LLM(
        tiny_weights_dir("llama"),
        pipeline_parallel_size=2,
        skip_tokenizer_init=True,
        max_num_batched_tokens=8000,
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.engine.executor.stats()  # type: ignore[union-attr]
    llm.engine.shutdown()
    first, last = ({(s, k): (a, b) for s, k, a, b in r["micro_batch_spans"]} for r in stats)
    assert first.keys() == last.keys()
    assert sorted(first) == [(1, 0), (1, 1), (2, 0), (2, 1)]  # the prefill step, then a decode
    spans = {key: (first[key], last[key]) for key in sorted(first)}
    print(spans)
    assert first[1, 1][0] < last[1, 0][1] and last[1, 0][0] < first[1, 1][1], spans


def _assert_stages_hold_their_layers(one: LLM, two: LLM) -> None:
    """Each stage's KV cache is its layers' share of the whole one; its weights are its layers',
    plus the embedding on the first stage and the final norm and LM head on the last; the
    rotary table is on both."""
    runner = one.engine.executor.runner
    assert isinstance(runner, ModelRunner)
    model: Any = runner.model
    num_layers = len(model.model.layers)
    per_layer_kv = kv_cache_bytes(runner.kv_caches) // num_layers
    stages = [PipelineStage(s, 2).layers(num_layers) for s in range(2)]
    memory = two.engine.executor.memory()  # type: ignore[union-attr]
    for (start, end), rank in zip(stages, memory):
        assert rank["kv_cache_bytes"] == (end - start) * per_layer_kv

    layers = [stored_bytes(model.model.layers[i]) for i in range(num_layers)]
    vocab, rotary = stored_bytes(model.model.embed_tokens), stored_bytes(model.model.rotary_emb)
    first = sum(layers[slice(*stages[0])]) + vocab + rotary
    last = sum(layers[slice(*stages[1])]) + stored_bytes(model.model.norm) + vocab + rotary
    assert [m["weight_bytes"] for m in memory] == [first, last]


def test_stages_split_the_layers_as_vllm() -> None:
    """num_layers // size each; the remainder goes to the stages before the last."""
    assert [PipelineStage(s, 2).layers(3) for s in range(2)] == [(0, 2), (2, 3)]
    assert [PipelineStage(s, 4).layers(10) for s in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        PipelineStage(0, 3).layers(2)


def test_micro_batches_split_tokens_evenly_and_keep_order() -> None:
    assert micro_batches([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert micro_batches([30, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert micro_batches([1, 1, 30], 2) == [range(0, 2), range(2, 3)]
    assert micro_batches([5], 2) == [range(0, 1)]  # a lone request: one micro-batch
    assert micro_batches([1, 1, 1], 4) == [range(0, 1), range(1, 2), range(2, 3)]
    for counts in ([3, 9, 2, 7, 1, 1], [1] * 7, [16, 16]):
        for count in (2, 3):
            runs = micro_batches(counts, count)
            assert [i for r in runs for i in r] == list(range(len(counts)))
            assert all(len(r) > 0 for r in runs) and len(runs) == min(count, len(counts))


@pytest.mark.slow  # the default suite checks PipelineStage.layers' ValueError directly
def test_more_stages_than_layers_is_a_value_error(tiny_weights_dir: Callable[[str], str]) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds"):
        LLM(tiny_weights_dir("qwen2"), pipeline_parallel_size=3, **ENGINE)


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
        ({"async_scheduling": True}, "async scheduling"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be >= 1"),
    ],
)
def test_unsupported_combinations_are_value_errors(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(**{"pipeline_parallel_size": 2, **extra})


@pytest.mark.slow
def test_smollm2_gguf_pp2_equals_one_process(smollm2_path: str) -> None:
    """The shipped GGUF, kept quantized: 30 layers as stages of 15, prompts of different
    lengths in one batch (so steps run as two micro-batches)."""
    prompts = [
        "The capital of France is",
        "Write a haiku about rain.",
        "1, 2, 3, 4,",
        "def fib(n):",
    ]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    want = LLM(num_gpu_blocks_override=64).generate(prompts, params, use_tqdm=False)
    llm = LLM(pipeline_parallel_size=2, num_gpu_blocks_override=64)
    assert_same_outputs(llm.generate(prompts, params, use_tqdm=False), want)
    llm.engine.shutdown()


@pytest.mark.slow
def test_tp2_times_pp2_equals_one_process(tiny_weights_dir: Callable[[str], str]) -> None:
    """Four ranks: two stages, each split over a tensor-parallel group of two."""
    folder = tiny_weights_dir("qwen3")
    want = _run(LLM(folder, **ENGINE))
    llm = LLM(folder, tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE)
    assert_same_outputs(_run(llm), want)
    llm.engine.shutdown()


@pytest.mark.slow
def test_a_killed_stage_fails_loudly(tiny_weights_dir: Callable[[str], str]) -> None:
    llm = LLM(tiny_weights_dir("llama"), pipeline_parallel_size=2, skip_tokenizer_init=True)
    kill_rank_1_mid_run(llm, "pipeline stage 1 .* died with exit code -9")
    llm.engine.shutdown()
