"""Speculative decoding end to end: with drafts, the engine outputs exactly what it outputs
without them, greedy and seeded sampling alike, in mixed batches (rows with and without drafts),
with chunked prefill, forced preemption, stop tokens, max_tokens, logprobs and n > 1.

A tiny random model never repeats itself, so prompt lookup proposes little and it would accept
nothing: the verification is driven by an oracle proposer instead, which proposes the plain
run's own continuation with some drafts corrupted, so steps accept all, some and none of their
drafts. The real n-gram proposer is checked on the embedded SmolLM2 copying a passage.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from pagoda import LLM, SamplingParams
from pagoda.outputs import RequestOutput

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
PROMPTS = [
    [(7 * j + 3) % 900 + 5 for j in range(5)],
    [(11 * j + 2) % 900 + 5 for j in range(19)],  # prefilled in chunks beside decodes
    [(13 * j + 1) % 900 + 5 for j in range(9)],
]
MAX_TOKENS = 24


def _llm(folder: str, spec: dict[str, Any] | None, **kwargs: Any) -> LLM:
    args: dict[str, Any] = dict(
        skip_tokenizer_init=True,
        num_gpu_blocks_override=64,
        block_size=4,
        max_num_batched_tokens=16,
        max_model_len=64,
    )
    args.update(kwargs)
    return LLM(folder, speculative_config=spec, **args)


def _run(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def _tokens(outs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


class OracleProposer:
    """Proposes each request's continuation from a plain run (truth[(prompt index, sample
    index)]: its output tokens), corrupting draft j of a proposal when (length + j) % 4 == 1,
    and proposing nothing to the prompts in `skip`: steps then accept every draft, a prefix, or
    none, and some rows of a batch have no drafts."""

    def __init__(self, truth: dict[tuple[int, int], list[int]]) -> None:
        self.truth = truth
        self.skip: set[int] = set()
        self.proposed = 0
        self.batch_sizes: list[int] = []

    def propose(self, requests: Sequence[tuple[str, Sequence[int], int]]) -> list[list[int]]:
        drafts = []
        self.batch_sizes.append(len(requests))
        for rid, tokens, allowed in requests:
            (i,) = [i for i, p in enumerate(PROMPTS) if list(tokens[: len(p)]) == p]
            sample = int(rid.split("#")[1]) if "#" in rid else 0
            truth, done = self.truth[(i, sample)], len(tokens) - len(PROMPTS[i])
            # A request that stopped inside its accepted drafts finished in the scheduler; the
            # runner's row holds its tokens past the stop until it is dropped next step.
            assert list(tokens[len(PROMPTS[i]) :])[: len(truth)] == truth[:done]
            if i in self.skip or allowed <= 0 or done >= len(truth):
                drafts.append([])
                continue
            draft = list(truth[done : done + min(3, allowed)])
            for j in range(len(draft)):
                if (len(tokens) + j) % 4 == 1:
                    draft[j] = (draft[j] + 1) % 1000
            self.proposed += len(draft)
            drafts.append(draft)
        return drafts

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        pass

    def remove(self, request_id: str) -> None:
        pass


def _with_oracle(llm: LLM, plain: list[RequestOutput]) -> OracleProposer:
    truth = {(i, c.index): list(c.token_ids) for i, o in enumerate(plain) for c in o.outputs}
    oracle = OracleProposer(truth)
    runner = llm.engine.runner
    assert runner.proposer is not None
    runner.proposer.proposer = oracle  # type: ignore[assignment]
    return oracle


@pytest.fixture(scope="module")
def folder(tiny_weights_dir: Any) -> str:
    return tiny_weights_dir("llama")


@pytest.fixture(scope="module")
def plain(folder: str) -> Iterator[LLM]:
    yield _llm(folder, None)


@pytest.fixture(scope="module")
def spec(folder: str) -> Iterator[LLM]:
    yield _llm(folder, NGRAM)


CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True),
    "processed": SamplingParams(
        temperature=0.8,
        seed=11,
        top_k=50,
        top_p=0.9,
        min_p=0.01,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={5: 2.0, 17: -3.0},
        min_tokens=6,
        max_tokens=MAX_TOKENS,
    ),
    "n2_logprobs": SamplingParams(
        temperature=1.0, seed=3, n=2, logprobs=2, max_tokens=MAX_TOKENS, ignore_eos=True
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_drafts_change_nothing(case: str, plain: LLM, spec: LLM) -> None:
    params = CASES[case]
    expected = _run(plain, params)
    oracle = _with_oracle(spec, expected)
    oracle.skip = {2}  # the third prompt decodes without drafts
    before = spec.engine.stats()
    got = _run(spec, params)
    assert _tokens(got) == _tokens(expected)
    after = spec.engine.stats()
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    # Drafts cut by the token budget are proposed but never verified.
    assert oracle.proposed >= drafted > accepted > 0  # some drafts held, some did not
    if params.logprobs is not None:
        for o_got, o_exp in zip(got, expected):
            for c_got, c_exp in zip(o_got.outputs, o_exp.outputs):
                assert c_got.logprobs is not None and c_exp.logprobs is not None
                for lp_got, lp_exp in zip(c_got.logprobs, c_exp.logprobs):
                    assert lp_got.keys() == lp_exp.keys()
                    for t in lp_got:
                        assert lp_got[t].logprob == pytest.approx(lp_exp[t].logprob, abs=1e-4)


def test_preemption_and_stops(folder: str) -> None:
    """A pool too small for all three requests preempts; a stop token inside accepted drafts
    ends the request there; max_tokens is never passed."""
    small = {"num_gpu_blocks_override": 12}
    plain = _llm(folder, None, **small)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = _run(plain, greedy)[0].outputs[0].token_ids
    stop = next(t for i, t in enumerate(first) if i >= 9 and t not in first[:i])
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        greedy,
    ]
    expected = _run(plain, params)
    assert plain.engine.stats().num_preemptions > 0
    spec = _llm(folder, NGRAM, **small)
    oracle = _with_oracle(spec, expected)
    got = _run(spec, params)
    assert _tokens(got) == _tokens(expected)
    assert spec.engine.stats().num_preemptions > 0 and oracle.proposed > 0
    assert got[0].outputs[0].token_ids[-1] == stop and got[0].outputs[0].finish_reason == "stop"
    assert len(got[0].outputs[0].token_ids) >= 10
    assert len(got[1].outputs[0].token_ids) == 7


def test_no_proposals_in_large_batches(folder: str, plain: LLM) -> None:
    """disable_by_batch_size: while more requests run than that, nothing is proposed; the
    last request left alone speculates again."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (8, 14, MAX_TOKENS)
    ]
    expected = _run(plain, params)
    spec = _llm(folder, {**NGRAM, "disable_by_batch_size": 1})
    oracle = _with_oracle(spec, expected)
    assert _tokens(_run(spec, params)) == _tokens(expected)
    assert oracle.batch_sizes and set(oracle.batch_sizes) == {1} and oracle.proposed > 0


def test_config_errors(folder: str) -> None:
    with pytest.raises(ValueError, match="async scheduling"):
        _llm(folder, NGRAM, async_scheduling=True)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _llm(folder, {"method": "ngram"})
    with pytest.raises(ValueError, match="not implemented yet"):
        _llm(folder, {"model": "self", "quantization": "int4", "num_speculative_tokens": 2})


COPY_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the "
    "wick, polished the great lens, and watched the ships pass safely along the rocky coast."
)


def test_ngram_on_smollm2_accepts_copied_text(smollm2_path: str) -> None:
    """The real proposer: SmolLM2 asked to repeat a passage; greedy output equals the plain
    run's, and most of it comes from accepted drafts."""
    params = SamplingParams(temperature=0.0, max_tokens=48)
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{COPY_TEXT}"}]
    plain = LLM(smollm2_path, max_model_len=512)
    expected = plain.chat(messages, params, use_tqdm=False)[0].outputs[0]
    del plain
    spec = LLM(smollm2_path, max_model_len=512, speculative_config=NGRAM)
    got = spec.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    stats = spec.engine.stats()
    print(f"\nngram on SmolLM2 copying: {len(got.token_ids)} tokens, {stats}")
    assert stats.spec_num_accepted_tokens >= len(got.token_ids) // 2, stats
