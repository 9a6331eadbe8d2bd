"""A grammar that starts after the reasoning (StructuredOutputsParams.reasoning_end, which the
server's --reasoning-parser sets to the ids of `</think>`; engine/grammar.py ReasoningGate).

The tiny random Llama stands in for a thinking model: a plain greedy run gives its free tokens,
and one of them (at position 2, or positions 1 and 2) is named as the end of the reasoning. The
grammar run must then give exactly the free tokens up to and including that end (no mask before
it: its first token is no prefix of the grammar's strings) and the grammar's language after it,
finishing with "stop" when the grammar ends. With speculative drafts (some refused) the output is
the same: the gate closes inside a step's drafts and the positions after it are masked."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagoda import LLM
from pagoda.sampling_params import SamplingParams
from pagoda.structured_outputs import StructuredOutputsParams
from tests.engine.test_structured_outputs import CorruptingOracle

PROMPTS = ["Give me a record:", "JSON please.", "The answer is", "Once upon a time"]
CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Callable[[str], str]) -> LLM:
    return LLM(tiny_model_dir("llama"), num_gpu_blocks_override=512)


def _free_tokens(llm: LLM, prompt: str) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)


def _gated(end: tuple[int, ...]) -> SamplingParams:
    grammar = StructuredOutputsParams(choice=CHOICES, reasoning_end=end)
    return SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=grammar)


@pytest.mark.parametrize("end_length", [1, 2])
def test_tokens_before_the_end_are_free_and_after_it_follow_the_grammar(
    tiny_llm: LLM, end_length: int
) -> None:
    tokenizer = tiny_llm.get_tokenizer()
    for prompt in PROMPTS:
        free = _free_tokens(tiny_llm, prompt)
        end = tuple(free[3 - end_length : 3])
        assert not any(tuple(free[i : i + end_length]) == end for i in range(3 - end_length))
        first = tokenizer.decode(free[:1])
        assert not any(c.startswith(first) for c in CHOICES), first  # the grammar refuses it
        out = tiny_llm.generate([prompt], _gated(end), use_tqdm=False)[0].outputs[0]
        assert out.token_ids[:3] == free[:3]
        assert tokenizer.decode(out.token_ids[3:]) in CHOICES
        assert out.finish_reason == "stop"
    # the same grammar without a reasoning end holds from the first token
    plain = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs={"choice": CHOICES})
    for o in tiny_llm.generate(PROMPTS, plain, use_tqdm=False):
        assert o.outputs[0].text in CHOICES


def test_an_end_that_never_comes_leaves_the_output_free(tiny_llm: LLM) -> None:
    vocab = tiny_llm.engine.executor.runner.model_config.vocab_size
    for prompt in PROMPTS[:2]:
        free = _free_tokens(tiny_llm, prompt)
        absent = next(t for t in range(vocab - 1, 0, -1) if t not in free)
        params = _gated((absent,))
        params = SamplingParams(
            temperature=0.0,
            max_tokens=8,
            ignore_eos=True,
            structured_outputs=params.structured_outputs,
        )
        out = tiny_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == free and out.finish_reason == "length"


def test_speculative_drafts_cross_the_end_of_the_reasoning(
    tiny_model_dir: Callable[[str], str], tiny_llm: LLM
) -> None:
    tokenizer = tiny_llm.get_tokenizer()
    bad = tokenizer.encode("Z", add_special_tokens=False)[0]  # no prefix of the choices
    spec = LLM(
        tiny_model_dir("llama"),
        num_gpu_blocks_override=512,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    runner = spec.engine.executor.runner
    assert runner.proposer is not None
    for prompt in PROMPTS:
        free = _free_tokens(tiny_llm, prompt)
        assert bad not in free[:3]
        params = _gated((free[2],))
        plain = tiny_llm.generate([prompt], params, use_tqdm=False)[0]
        truth = {tuple(plain.prompt_token_ids): list(plain.outputs[0].token_ids)}
        oracle = CorruptingOracle(truth, bad)
        runner.proposer.proposer = oracle  # type: ignore[assignment]
        before = spec.engine.stats()
        got = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        after = spec.engine.stats()
        assert got.token_ids == plain.outputs[0].token_ids
        assert got.finish_reason == "stop"
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        assert oracle.proposed > 0 and accepted > 0
