"""Async scheduling (vLLM's --async-scheduling) gives exactly the outputs of the synchronous
engine: step k + 1 is scheduled and launched before step k is updated, its decodes read their
input token from the device, and finished or aborted requests' in-flight work is dropped.

On CPU the model runs on the host, so nothing overlaps here; what is tested is that the
reordered bookkeeping changes no token, finish reason or block, and no logprob beyond the
rounding the determinism rule allows (tests/equivalence.py: batches differ between the two
engines; on the CPU kernels' attention a row's bits do not depend on its batch, so the logprobs
agree exactly there). The comparisons run on the tiny float32 Llama and on the default path, the
embedded SmolLM2 GGUF on pagoda's CPU kernels. The triton backend with
padded decode batches runs async in tests/engine/test_triton_backend.py, compiled decode steps
(-O2) in tests/engine/test_compiled_decode.py; tests/gpu/ repeats the comparison with CUDA
graphs and real overlap.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig
from pagoda.kernels.cpu import kernels
from pagoda.outputs import RequestOutput
from pagoda.scheduling.messages import EngineRequest
from tests.equivalence import assert_same_outputs

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _prompts(n: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 1000) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(10, 1000) for _ in range(rng.randint(3, 60))] for _ in range(n)]


PROMPTS = _prompts(12, shared_prefix=20)
BIASED = 500  # a token id that a logit bias makes greedy's first choice


def _llm(path: str, async_scheduling: bool, **kwargs: Any) -> LLM:
    kwargs.setdefault("num_gpu_blocks_override", 512)
    return LLM(path, skip_tokenizer_init=True, async_scheduling=async_scheduling, **kwargs)


def _outputs(llm: LLM, prompts: list[list[int]], params: Any) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir: Any) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module", params=["tiny-llama", "smollm2-gguf"])
def model(request: pytest.FixtureRequest) -> str:
    """The tiny float32 Llama, and the default path: the embedded SmolLM2 Q4_1 GGUF on pagoda's
    CPU kernels (int8-rounded matmul inputs, where any last-bit difference would show)."""
    if request.param == "tiny-llama":
        return str(request.getfixturevalue("tiny_model_dir")("llama"))
    if kernels() is None:
        pytest.skip("pagoda's CPU kernels are not built: the default path is torch's")
    return str(request.getfixturevalue("smollm2_path"))


@pytest.fixture(scope="module")
def sync_greedy(model: str) -> list[RequestOutput]:
    return _outputs(_llm(model, False), PROMPTS, GREEDY)


def test_default_is_on_for_cuda_only() -> None:
    assert not EngineConfig(device="cpu").use_async_scheduling
    assert EngineConfig(device="cpu", async_scheduling=True).use_async_scheduling
    assert EngineConfig(device="cuda").use_async_scheduling
    assert not EngineConfig(device="cuda", async_scheduling=False).use_async_scheduling


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 16},  # prompts in many chunks beside decodes
        {"num_gpu_blocks_override": 24},  # preemption while steps are in flight
        {"enable_prefix_caching": False, "max_num_seqs": 3},
    ],
    ids=["batch", "chunked", "preempting", "3-seqs"],
)
def test_async_greedy_equals_sync(
    model: str, sync_greedy: list[RequestOutput], engine_args: dict[str, Any]
) -> None:
    llm = _llm(model, True, **engine_args)
    assert llm.engine.async_scheduling
    assert_same_outputs(_outputs(llm, PROMPTS, GREEDY), sync_greedy)
    if "num_gpu_blocks_override" in engine_args:
        assert llm.engine.stats().num_preemptions > 0
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks


def _feature_params(stop_token: int) -> list[SamplingParams]:
    """One request per feature that reads the request's state when its step is scheduled."""
    return [
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, seed=1, max_tokens=16),
        # Greedy with penalties: the bias makes BIASED greedy's choice until it is output once;
        # if the output in flight were not counted, the next step would pick it again.
        SamplingParams(
            temperature=0.0,
            logit_bias={BIASED: 10.0},
            frequency_penalty=2.0,
            presence_penalty=2.0,
            repetition_penalty=5.0,
            max_tokens=16,
        ),
        SamplingParams(
            temperature=0.7, seed=3, presence_penalty=1.5, frequency_penalty=1.0, max_tokens=16
        ),
        SamplingParams(temperature=0.0, stop_token_ids=[stop_token], max_tokens=16),
        # BIASED is greedy's choice from the start, banned until the 6th output is out: an
        # in-flight output left uncounted would stop one token late.
        SamplingParams(
            temperature=0.0,
            min_tokens=6,
            stop_token_ids=[BIASED],
            logit_bias={BIASED: 30.0},
            max_tokens=16,
        ),
        SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2, max_tokens=8),
        SamplingParams(temperature=0.8, n=3, seed=5, max_tokens=10, logprobs=1),
        SamplingParams(temperature=0.0, logit_bias={stop_token: 100.0}, max_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]


def test_async_sampling_features_equal_sync(model: str, sync_greedy: list[RequestOutput]) -> None:
    # A token greedy decoding of prompt 3 first emits at its 3rd step or later: a stop in
    # mid-flight.
    greedy = sync_greedy[3].outputs[0].token_ids
    at = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])
    stop_token = greedy[at]
    prompts = PROMPTS[: len(_feature_params(stop_token))]
    params = _feature_params(stop_token)
    expected = _outputs(_llm(model, False), prompts, params)
    stopped = expected[3].outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_token)
    assert len(stopped.token_ids) == at + 1
    min_tokens_out = expected[4].outputs[0]
    assert min_tokens_out.token_ids[6:] == [BIASED]
    assert (min_tokens_out.finish_reason, min_tokens_out.stop_reason) == ("stop", BIASED)
    penalized = expected[1].outputs[0].token_ids
    assert penalized[0] == BIASED and penalized[1] != BIASED
    assert_same_outputs(_outputs(_llm(model, True), prompts, params), expected)


def test_no_extra_token_is_computed_for_length_capped_requests(tiny_llama: str) -> None:
    def scheduled_tokens(async_scheduling: bool) -> int:
        llm = _llm(tiny_llama, async_scheduling, max_num_seqs=4)
        counts: list[int] = []
        execute = llm.engine.executor.runner.execute

        def spy(out: Any) -> Any:
            counts.append(out.num_scheduled_tokens)
            return execute(out)

        llm.engine.executor.runner.execute = spy  # type: ignore[method-assign]
        _outputs(llm, PROMPTS, GREEDY)
        return sum(counts)

    assert scheduled_tokens(True) == scheduled_tokens(False)


def test_abort_and_id_reuse_while_a_step_is_in_flight(tiny_llama: str) -> None:
    stop_params = SamplingParams(temperature=0.0, max_tokens=12)
    sync = _llm(tiny_llama, False)
    alone = {i: _outputs(sync, [PROMPTS[i]], GREEDY)[0].outputs[0].token_ids for i in (0, 1, 2)}
    first_tokens = alone[0][:3]

    engine = _llm(tiny_llama, True).engine
    engine.add_request(EngineRequest("a", PROMPTS[0], stop_params))
    engine.add_request(EngineRequest("b", PROMPTS[1], GREEDY))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(4):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert engine.in_flight is not None and tokens["a"] == first_tokens
    engine.abort_request("a")  # its fifth step is in flight
    # The same id again at once: the in-flight step's token must not reach the new request.
    engine.add_request(EngineRequest("a", PROMPTS[2], GREEDY))
    tokens["a"] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens == {"a": alone[2], "b": alone[1]}
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
