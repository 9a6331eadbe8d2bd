"""Structured outputs in the engine (engine/grammar.py, runner/grammar_mask.py): every output
under a JSON schema parses and validates against it (jsonschema), a regex and a choice list
hold, a grammar that allows one string produces exactly it; sampled at temperature 1.0 on the
tiny Llama (random weights: the mask alone keeps it inside) and on SmolLM2, with n > 1, seeds,
penalties, stop strings and async scheduling."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from pagoda import LLM
from pagoda.client.tool_calls import parse_tool_calls
from pagoda.engine.grammar import GrammarCompiler
from pagoda.runner.draft_sampling import DraftSampler
from pagoda.sampling_params import SamplingParams
from pagoda.server.protocol import ChatCompletionRequest
from pagoda.server.tools import tool_plan
from pagoda.structured_outputs import StructuredOutputsParams
from tests.drafts import FixedDrafts

PROMPTS = ["Give me a record:", "JSON please.", "The answer is", "Once upon a time"]

# Bounded strings, arrays and numbers: sampled at temperature 1.0 from a random model, every
# output must end inside max_tokens.
SCHEMAS: list[dict[str, Any]] = [
    {  # nested objects, required and optional fields
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "zip": {"type": "integer", "minimum": 1000, "maximum": 9999},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    {  # arrays and enums
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "mode": {"enum": ["fast", "slow", 3]},
        },
        "required": ["tags", "mode"],
        "additionalProperties": False,
    },
    {  # numbers with bounds, booleans, null
        "type": "object",
        "properties": {
            "score": {"type": "integer", "minimum": -5, "maximum": 120},
            "ok": {"type": "boolean"},
            "note": {"type": "null"},
        },
        "required": ["score", "ok", "note"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
]


def _structured(**kw: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Callable[[str], str]) -> LLM:
    return LLM(tiny_model_dir("llama"), num_gpu_blocks_override=512)


def _texts(llm: LLM, params: SamplingParams, prompts: list[str] = PROMPTS) -> list[Any]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [c for o in outs for c in o.outputs]


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_output_validates_against_its_schema(tiny_llm: LLM, index: int) -> None:
    schema = SCHEMAS[index]
    params = SamplingParams(
        temperature=1.0,
        seed=index,
        n=2,
        max_tokens=200,
        structured_outputs=_structured(json=schema, disable_any_whitespace=True),
    )
    for c in _texts(tiny_llm, params):
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        jsonschema.validate(json.loads(c.text), schema)


def test_json_object_with_flexible_whitespace(tiny_llm: LLM) -> None:
    params = SamplingParams(
        temperature=1.0, seed=7, max_tokens=300, structured_outputs={"json_object": True}
    )
    outs = _texts(tiny_llm, params)
    finished = [c for c in outs if c.finish_reason == "stop"]
    for c in finished:
        assert isinstance(json.loads(c.text), dict)
    for c in outs:  # a random model may still be inside a string at max_tokens
        assert c.finish_reason in ("stop", "length")
        assert c.text.lstrip().startswith("{")


def test_regex_and_choice_hold(tiny_llm: LLM) -> None:
    pattern = r"[a-c]{3}-[0-9]{2}(!|\?)"
    params = SamplingParams(
        temperature=1.0, seed=1, n=3, max_tokens=32, structured_outputs={"regex": pattern}
    )
    for c in _texts(tiny_llm, params):
        assert re.fullmatch(pattern, c.text), c.text
        assert c.finish_reason == "stop"
    choices = ["Paris", "London", "New York City"]
    params = SamplingParams(
        temperature=1.0, seed=2, n=4, max_tokens=16, structured_outputs={"choice": choices}
    )
    seen = {c.text for c in _texts(tiny_llm, params)}
    assert seen <= set(choices) and len(seen) >= 2


def test_a_grammar_of_one_string_gives_exactly_it(tiny_llm: LLM) -> None:
    grammar = 'start: "pagoda " NAME\nNAME: "serves" " " "fast"'
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature, seed=3, max_tokens=32, structured_outputs={"grammar": grammar}
        )
        for c in _texts(tiny_llm, params):
            assert c.text == "pagoda serves fast" and c.finish_reason == "stop"
    gbnf = 'root ::= "yes" | "no"'  # llama.cpp's GBNF is taken too
    params = SamplingParams(
        temperature=1.0, seed=4, max_tokens=8, structured_outputs={"grammar": gbnf}
    )
    assert {c.text for c in _texts(tiny_llm, params)} <= {"yes", "no"}


def test_composes_with_sampling_parameters_and_stops(tiny_llm: LLM) -> None:
    schema = SCHEMAS[2]
    base = dict(
        max_tokens=200,
        structured_outputs=_structured(json=schema, disable_any_whitespace=True),
    )
    variants = [
        SamplingParams(temperature=0.0, **base),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, seed=5, **base),
        SamplingParams(
            temperature=1.0, presence_penalty=1.5, repetition_penalty=1.3, seed=6, **base
        ),
        SamplingParams(temperature=1.0, seed=8, min_tokens=4, logprobs=2, **base),
    ]
    for params in variants:
        for c in _texts(tiny_llm, params):
            jsonschema.validate(json.loads(c.text), schema)
    # Seeded: the same tokens again, whatever runs beside it.
    seeded = variants[1]
    alone = _texts(tiny_llm, seeded, PROMPTS[:1])[0].token_ids
    beside = _texts(tiny_llm, seeded, PROMPTS[:1] + PROMPTS[1:] * 2)[0].token_ids
    assert alone == beside
    # A stop string ends the output early (the client's check), grammar or not.
    stop = SamplingParams(
        temperature=0.0,
        stop=['"ok"'],
        max_tokens=200,
        structured_outputs=base["structured_outputs"],
    )
    for c in _texts(tiny_llm, stop):
        assert '"ok"' not in c.text and c.finish_reason == "stop"


def test_requests_without_a_grammar_are_untouched(tiny_llm: LLM) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, plain, use_tqdm=False)]
    mixed = [
        plain,
        SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"regex": "[0-9]+"}),
    ] * 2
    outs = tiny_llm.generate(PROMPTS, mixed, use_tqdm=False)
    assert [outs[i].outputs[0].token_ids for i in (0, 2)] == [before[0], before[2]]
    assert all(re.fullmatch("[0-9]+", outs[i].outputs[0].text) for i in (1, 3))


def test_async_scheduling_gives_the_same_outputs(tiny_model_dir: Callable[[str], str]) -> None:
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=200,
            structured_outputs=_structured(json=SCHEMAS[i % 2], disable_any_whitespace=True),
        )
        for i in range(4)
    ] + [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]
    prompts = PROMPTS + ["and one without a grammar"]
    outs = {}
    for mode in (False, True):
        llm = LLM(tiny_model_dir("llama"), num_gpu_blocks_override=256, async_scheduling=mode)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[True] == outs[False]


def test_tool_calls_under_required_and_named_tool_choice(tiny_llm: LLM) -> None:
    """The server's grammar for tool_choice "required" / a named function (server/tools.py) on
    a random model at temperature 1.0: every output is Hermes calls to the given functions whose
    arguments validate against their schemas."""
    tools = [
        {"type": "function", "function": {"name": "lookup", "parameters": SCHEMAS[0]}},
        {"type": "function", "function": {"name": "paint", "parameters": SCHEMAS[1]}},
    ]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    named = {"type": "function", "function": {"name": "paint"}}
    for i, (choice, parallel) in enumerate(
        [("required", False), ("required", True), (named, True)]
    ):
        body = ChatCompletionRequest.model_validate(
            {"messages": [], "tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}
        )
        grammar = tool_plan(body, False, None).grammar
        params = SamplingParams(
            temperature=1.0, seed=i, n=2, max_tokens=300, structured_outputs=grammar
        )
        for c in _texts(tiny_llm, params):
            content, calls = parse_tool_calls(c.text)
            assert content is None and calls, c.text
            if not parallel:
                assert len(calls) == 1 and c.finish_reason == "stop"
            for k, call in enumerate(calls):
                if choice == named:
                    assert call.name == "paint"
                if k < len(calls) - 1 or c.finish_reason == "stop":  # the last may be cut off
                    jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_smollm2_follows_a_schema(smollm2_llm: LLM) -> None:
    schema = SCHEMAS[0]
    tokenizer = smollm2_llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a person who lives in Paris as JSON."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    params = SamplingParams(
        temperature=1.0, seed=0, n=3, max_tokens=120, structured_outputs={"json": schema}
    )
    for c in _texts(smollm2_llm, params, [prompt]):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_smollm2_calls_a_tool_through_llm_chat(smollm2_llm: LLM) -> None:
    """The Python API: LLM.chat(tools=...) puts the tools in the prompt (SmolLM2's template has
    none: the Hermes system block), the named-function grammar makes the call, and
    parse_tool_calls reads it."""
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [],
            "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=tool_plan(body, False, None).grammar
    )
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = smollm2_llm.chat(messages, params, use_tqdm=False, tools=tools)[0]
    assert "<tools>" in (out.prompt or "") and '"get_weather"' in (out.prompt or "")
    content, [call] = parse_tool_calls(out.outputs[0].text)
    assert content is None and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), parameters)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"regex": "(unclosed"}, "structured_outputs.regex"),
        (
            {"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
            "structured_outputs.json",
        ),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ],
)
def test_an_invalid_grammar_is_refused_before_it_is_queued(
    tiny_llm: LLM, fields: dict[str, Any], match: str
) -> None:
    params = SamplingParams(max_tokens=4, structured_outputs=fields)
    with pytest.raises(ValueError, match=match):
        tiny_llm.generate(["x"], params, use_tqdm=False)
    # the engine goes on
    ok = tiny_llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 2


class CorruptingOracle(FixedDrafts):
    """Proposes each request's continuation from a plain run (`truth`, keyed by prompt tokens),
    with draft j replaced by `bad` when (length + j) % 3 == 1: steps accept every draft, some or
    none, and the replaced drafts are tokens the grammar refuses."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], bad: int) -> None:
        self.truth, self.bad, self.proposed = truth, bad, 0

    def propose(self, requests: Any) -> list[list[int]]:
        drafts = []
        for _, tokens, allowed in requests:
            prompt = next(p for p in self.truth if tuple(tokens[: len(p)]) == p)
            truth, done = self.truth[prompt], len(tokens) - len(prompt)
            draft = list(truth[done : done + min(3, allowed)]) if allowed > 0 else []
            for j in range(len(draft)):
                if (len(tokens) + j) % 3 == 1:
                    draft[j] = self.bad
            self.proposed += len(draft)
            drafts.append(draft)
        return drafts


def test_speculative_drafts_are_checked_against_the_grammar(
    tiny_model_dir: Callable[[str], str], tiny_llm: LLM
) -> None:
    """With drafts, a grammar request outputs exactly what it does without them, greedy and
    seeded: each position is masked after the drafts before it, and a draft the grammar refuses
    is rejected. Drafts come from the plain run, some replaced by a refused token."""
    schema = SCHEMAS[1]
    grammar = _structured(json=schema, disable_any_whitespace=True)
    cases = [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=grammar),
        SamplingParams(temperature=1.0, seed=9, max_tokens=60, structured_outputs=grammar),
        SamplingParams(
            temperature=1.0, seed=10, max_tokens=30, structured_outputs={"regex": "[a-f]{5,40}"}
        ),
    ]
    tokenizer = tiny_llm.get_tokenizer()
    bad = tokenizer.encode("Z", add_special_tokens=False)[0]  # in no output of these grammars
    spec = LLM(
        tiny_model_dir("llama"),
        num_gpu_blocks_override=512,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    runner = spec.engine.executor.runner
    assert runner.proposer is not None
    for params in cases:
        plain = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
        truth = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in plain}
        oracle = CorruptingOracle(truth, bad)
        runner.proposer.proposer = oracle  # type: ignore[assignment]
        before = spec.engine.stats()
        got = spec.generate(PROMPTS, params, use_tqdm=False)
        after = spec.engine.stats()
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
        assert [o.outputs[0].finish_reason for o in got] == ["stop"] * len(PROMPTS)
        drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        assert oracle.proposed > 0 and 0 < accepted < drafted, (accepted, drafted)


def test_a_draft_model_samples_its_drafts_under_the_grammar(
    tiny_model_dir: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft model's drafts are drawn under the request's grammar (engine/grammar.py
    draft_mask, runner/draft_sampling.py): at draft j the mask after the request's outputs and
    drafts 0..j-1, as the target's mask at that position. Checked against a fresh matcher
    walked over the same tokens: every draft is a token the grammar allows there, and a sampled
    request's q has no mass outside it. Random weights: unmasked, the drafts would be refused."""
    captured: list[tuple[str, list[int], int, torch.Tensor | None]] = []
    sample = DraftSampler._sample

    def spy(self: DraftSampler, logits: torch.Tensor, rows: list[Any]) -> torch.Tensor:
        before = [self._proposals[r.request_id].tokens[:j] if j else [] for r, j in rows]
        tokens = sample(self, logits, rows)
        for (row, _), drafts, token in zip(rows, before, tokens.tolist()):
            q = self._proposals[row.request_id].probs[-1]
            captured.append((row.request_id, list(row.output_token_ids) + drafts, token, q))
        return tokens

    monkeypatch.setattr(DraftSampler, "_sample", spy)
    llm = LLM(
        tiny_model_dir("llama"),
        num_gpu_blocks_override=512,
        speculative_config={"model": "self", "quantization": "int4", "num_speculative_tokens": 3},
    )
    grammar = _structured(regex="[a-f]{5,40}")
    cases = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=grammar),
        "sampled": SamplingParams(
            temperature=1.0, seed=4, max_tokens=30, structured_outputs=grammar
        ),
    }
    tokenizer = llm.get_tokenizer()
    runner = llm.engine.executor.runner
    vocab = runner.model_config.vocab_size
    compiler = GrammarCompiler(lambda: tokenizer, vocab, runner.eos_token_ids)
    template = compiler.compile(grammar).result(timeout=60)
    words = (runner.model_config.vocab_size + 31) // 32
    for name, params in cases.items():
        captured.clear()
        before = llm.engine.stats()
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for o in outs:
            assert re.fullmatch("[a-f]{5,40}", o.outputs[0].text), o.outputs[0].text
        accepted = llm.engine.stats().spec_num_accepted_tokens - before.spec_num_accepted_tokens
        assert captured and accepted > 0
        checked = 0
        for _, tokens, token, q in captured:
            if set(tokens) & set(runner.eos_token_ids):
                continue  # ended this step: the scheduler drops its drafts, unverified
            checked += 1
            matcher = template.deep_copy()
            assert matcher.consume_tokens(tokens)
            mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)[:words]
            bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
            allowed = torch.from_numpy(bits[: runner.model_config.vocab_size].astype(bool))
            assert allowed[token], (name, tokens, token)
            assert (q is None) == (name == "greedy")
            if q is not None:
                assert q[~allowed].sum().item() == 0.0
        assert checked > len(captured) // 2
    compiler.shutdown()
