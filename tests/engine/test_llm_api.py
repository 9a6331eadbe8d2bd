"""The LLM API end to end on a tiny random model: outputs, sampling, n > 1, stops, errors."""

from __future__ import annotations

import pytest

from pagoda import LLM, EngineRequest, SamplingParams
from pagoda.scheduling.request import RequestStatus

PROMPT = {
    "prompt_token_ids": [
        11,
        22,
        33,
        44,
        55,
        66,
        77,
        88,
        99,
        111,
        222,
        333,
        444,
        555,
        666,
        777,
        888,
        999,
        1234,
    ]
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir("llama"), num_gpu_blocks_override=128, max_num_seqs=32)


def test_request_output_shape(llm: LLM) -> None:
    outs = llm.generate(["Hello there", PROMPT], SamplingParams(max_tokens=5, temperature=0))
    assert [o.request_id for o in outs] == sorted({o.request_id for o in outs}, key=int)
    first = outs[0]
    assert first.prompt == "Hello there"
    assert first.prompt_token_ids == llm.get_tokenizer().encode("Hello there")
    assert first.finished and len(first.outputs) == 1
    c = first.outputs[0]
    assert c.index == 0 and len(c.token_ids) <= 5 and c.finish_reason in ("length", "stop")
    assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
    m = first.metrics
    assert m is not None and m.arrival_time <= m.first_token_time <= m.finished_time
    assert m.first_scheduled_time is not None
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert outs[1].prompt is None and outs[1].prompt_token_ids == PROMPT["prompt_token_ids"]


def test_one_params_per_prompt_and_mismatch(llm: LLM) -> None:
    outs = llm.generate(
        [PROMPT, PROMPT],
        [
            SamplingParams(max_tokens=2, ignore_eos=True),
            SamplingParams(max_tokens=4, ignore_eos=True),
        ],
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 4]
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate([PROMPT, PROMPT], [SamplingParams()])


@pytest.mark.parametrize(
    "bad",
    [{"temperature": 0}, [{"temperature": 0}], "temperature=0", 0.5, [SamplingParams(), None]],
    ids=["dict", "list_of_dict", "str", "float", "list_with_none"],
)
def test_sampling_params_of_the_wrong_type_is_a_type_error(llm: LLM, bad: object) -> None:
    """A dict (or anything but SamplingParams) names what to pass instead, before any request
    reaches the engine, in every entry point."""
    match = "sampling_params must be a SamplingParams"
    with pytest.raises(TypeError, match=match):
        llm.generate([PROMPT], bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=match):
        llm.chat([{"role": "user", "content": "hi"}], bad)  # type: ignore[arg-type]
    if not isinstance(bad, list):
        with pytest.raises(TypeError, match=match):
            next(llm.generate_stream(PROMPT, bad))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=match):
            next(llm.chat_stream([{"role": "user", "content": "hi"}], bad))  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished_requests()


def test_dict_sampling_params_error_says_how_to_fix_it(llm: LLM) -> None:
    with pytest.raises(TypeError, match=r"got dict; for a dict d, pass SamplingParams\(\*\*d\)"):
        llm.generate([PROMPT], {"temperature": 0})  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [{"beam_width": 2, "max_tokens": 4}, SamplingParams(), None])
def test_beam_search_params_of_the_wrong_type_is_a_type_error(llm: LLM, bad: object) -> None:
    with pytest.raises(TypeError, match="params must be a BeamSearchParams"):
        llm.beam_search([PROMPT], bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "priority", [[0.5], [None], ["1"], [True], 3], ids=["float", "none", "str", "bool", "int"]
)
def test_non_integer_priority_is_a_value_error(llm: LLM, priority: object) -> None:
    with pytest.raises(ValueError, match="priority must be a list of ints"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2), priority=priority)  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished_requests()


def test_top_k_1_equals_greedy(llm: LLM) -> None:
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    topk1 = llm.generate(
        PROMPT, SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True)
    )
    assert greedy[0].outputs[0].token_ids == topk1[0].outputs[0].token_ids


def test_seeded_request_repeats_alone_and_in_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded)[0].outputs[0].token_ids
    again = llm.generate(PROMPT, seeded)[0].outputs[0].token_ids
    batch = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}, PROMPT, {"prompt_token_ids": [9] * 30}],
        [other, seeded, other],
    )
    assert alone == again == batch[1].outputs[0].token_ids


def test_n_samples_share_prompt_blocks(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    engine.add_request(EngineRequest("fork", PROMPT["prompt_token_ids"], params))
    engine.step()  # the whole 19-token prompt is prefilled and 3 first tokens are sampled
    kv = engine.kv_cache_manager
    tables = [kv.get_block_ids(rid) for rid in ("fork", "fork#1", "fork#2")]
    assert tables[0] == tables[1] == tables[2]
    first_block = kv.req_blocks["fork"][0]
    assert first_block.ref_cnt == 3
    engine.step()  # each sample writes into the shared partial block: copy-on-write
    tables = [kv.get_block_ids(rid) for rid in ("fork", "fork#1", "fork#2")]
    assert tables[0][0] == tables[1][0] == tables[2][0]
    assert len({t[1] for t in tables}) == 3
    engine.abort_request("fork")
    assert not engine.has_unfinished_requests()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks

    outs = llm.generate(PROMPT, params)
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in outs[0].outputs)
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1


def test_stop_strings_cut_text(llm: LLM) -> None:
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    text = base[0].outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate(
        PROMPT,
        SamplingParams(
            temperature=0,
            max_tokens=30,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    assert not llm.engine.has_unfinished_requests()


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    tokens = base[0].outputs[0].token_ids
    stop_tok = tokens[2]
    first = tokens.index(stop_tok)
    out = llm.generate(
        PROMPT,
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_tok]),
    )[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_logprobs_and_prompt_logprobs(llm: LLM) -> None:
    out = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    )[0]
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    for token, step in zip(c.token_ids, c.logprobs):
        assert step[token].rank == 1  # greedy picks the top token
        assert len(step) == 3  # the sampled token is also the top-1
    assert c.cumulative_logprob == pytest.approx(
        sum(s[t].logprob for t, s in zip(c.token_ids, c.logprobs))
    )
    plp = out.prompt_logprobs
    assert plp is not None and plp[0] is None and len(plp) == len(PROMPT["prompt_token_ids"])
    for token, pos in zip(PROMPT["prompt_token_ids"][1:], plp[1:]):
        assert pos is not None and token in pos and pos[token].logprob <= 0


def test_prompt_logprobs_in_slices_equal_whole(llm: LLM, tiny_model_dir) -> None:
    """With max_num_seqs=4 the runner scores the 18 prompt positions in 5 slices of at most 4
    rows (the LM-head peak profile_run measures); the result equals one whole-prompt pass."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    sliced = LLM(tiny_model_dir("llama"), num_gpu_blocks_override=128, max_num_seqs=4)
    got = sliced.generate(PROMPT, params)[0].prompt_logprobs
    want = llm.generate(PROMPT, params)[0].prompt_logprobs
    assert got is not None and want is not None and len(got) == len(want) == 19
    for g, w in zip(got[1:], want[1:]):
        assert g is not None and w is not None and list(g) == list(w)
        for token in w:
            assert g[token].rank == w[token].rank
            assert g[token].logprob == pytest.approx(w[token].logprob, abs=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params_raise(kwargs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ({"prompt_token_ids": [1, -3]}, SamplingParams(), "token ids"),
        ({"prompt_token_ids": [1, 10**9]}, SamplingParams(), "token ids"),
        ({"prompt_token_ids": [1] * 300}, SamplingParams(), "maximum context length"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=400), "maximum context length"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
        ({"prompt_token_ids": [1]}, SamplingParams(allowed_token_ids=[10**9]), "allowed_token_ids"),
        ({"prompt_token_ids": [1]}, SamplingParams(logit_bias={10**9: 1.0}), "logit_bias"),
        (42, SamplingParams(), "prompt"),
        ({"prompt_token_ids": "abc"}, SamplingParams(), "prompt_token_ids"),
    ],
)
def test_bad_requests_raise_and_engine_keeps_serving(tiny_model_dir, prompt, params, match) -> None:
    llm = _small_llm(tiny_model_dir)
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPT, prompt], params)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


_SMALL: dict[str, LLM] = {}


def _small_llm(tiny_model_dir) -> LLM:
    if "llm" not in _SMALL:
        _SMALL["llm"] = LLM(tiny_model_dir("llama"), max_model_len=256, num_gpu_blocks_override=64)
    return _SMALL["llm"]


def test_request_larger_than_pool_rejected(tiny_model_dir) -> None:
    llm = LLM(tiny_model_dir("llama"), max_model_len=256, num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate(PROMPT, SamplingParams(max_tokens=100))
    assert len(llm.generate(PROMPT, SamplingParams(max_tokens=8))[0].outputs[0].token_ids) <= 8


def test_abort_mid_run_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    for i in range(3):
        engine.add_request(
            EngineRequest(
                f"a{i}", PROMPT["prompt_token_ids"], SamplingParams(max_tokens=50, ignore_eos=True)
            )
        )
    engine.step()
    engine.abort_request("a1")
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert {o.request_id for o in outs if o.finish_reason} == {"a0", "a2"}
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.num_blocks
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"


def test_priority_scheduling(tiny_model_dir) -> None:
    llm = LLM(
        tiny_model_dir("llama"),
        scheduling_policy="priority",
        max_num_seqs=1,
        num_gpu_blocks_override=64,
    )
    outs = llm.generate(
        [PROMPT, PROMPT, PROMPT], SamplingParams(max_tokens=2, ignore_eos=True), priority=[5, 0, 1]
    )
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_token_time)
    assert order == [1, 2, 0]


def test_cache_salt_isolates_prefix_cache(tiny_model_dir) -> None:
    llm = LLM(tiny_model_dir("llama"), num_gpu_blocks_override=64)
    ids = list(range(100, 140))  # 40 tokens: two full 16-token blocks can hit
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate({"prompt_token_ids": ids, "cache_salt": "alice"}, params)
    bob = llm.generate({"prompt_token_ids": ids, "cache_salt": "bob"}, params)[0]
    alice = llm.generate({"prompt_token_ids": ids, "cache_salt": "alice"}, params)[0]
    assert bob.num_cached_tokens == 0
    assert alice.num_cached_tokens == 32
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": ids, "cache_salt": 5}, params)
