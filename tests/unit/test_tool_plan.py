"""What a chat request's tools, tool_choice and parallel_tool_calls ask for (server/tools.py), as
vLLM answers them: the 400s naming their field, and the grammar behind "required" and a named
function accepting the calls it should and nothing else."""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.hf
import pytest

from pagoda.server.errors import APIError
from pagoda.server.protocol import ChatCompletionRequest
from pagoda.server.tools import ToolPlan, tool_plan

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},  # no parameters: an empty object
]


def _plan(auto: bool = True, **fields: Any) -> ToolPlan:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )
    return tool_plan(body, auto, "hermes" if auto else None)


def _error(**fields: Any) -> APIError:
    auto = fields.pop("auto", True)
    with pytest.raises(APIError) as e:
        _plan(auto, **fields)
    assert e.value.status == 400
    return e.value


def test_modes() -> None:
    assert _plan() == ToolPlan()
    assert _plan(tool_choice="none") == ToolPlan()
    auto = _plan(tools=TOOLS)
    assert (auto.mode, auto.parse, auto.grammar) == ("auto", True, None)
    assert auto.tools is not None and auto.tools[1] == {
        "type": "function",
        "function": {"name": "now"},
    }
    none = _plan(tools=TOOLS, tool_choice="none")
    assert (none.mode, none.parse, none.grammar, none.tools) == ("none", False, None, auto.tools)
    required = _plan(tools=TOOLS, tool_choice="required")
    assert required.parse and required.grammar is not None
    named = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert named.mode == "named" and named.grammar is not None
    # finish reasons: a call that stops is "tool_calls", a named call "stop", a cut one "length"
    assert required.finish_reason("stop", 1) == "tool_calls"
    assert required.finish_reason("length", 1) == "length"
    assert auto.finish_reason("stop", 0) == "stop"
    assert named.finish_reason("stop", 1) == "stop"


def test_refusals_name_their_field() -> None:
    e = _error(tools=TOOLS, auto=False)
    assert e.param == "tool_choice" and "--enable-auto-tool-choice" in e.message
    assert _error(tool_choice="required").param == "tool_choice"  # no tools
    e = _error(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.param == "tool_choice" and "'nope'" in e.message
    assert _error(tools=TOOLS + TOOLS[:1], tool_choice="required").param == "tools"
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    assert _error(tools=bad, tool_choice="required").param == "tools"
    e = _error(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert e.param == "tool_choice"
    # a response_format of type text is no grammar
    assert _plan(tools=TOOLS, tool_choice="required", response_format={"type": "text"}).parse


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer: Any) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(
        smollm2_tokenizer, n_vocab=49152, eos_token=[smollm2_tokenizer.eos_token_id]
    )


def _accepts(plan: ToolPlan, tokenizer: llguidance.LLTokenizer, tok: Any, text: str) -> bool:
    """Whether the plan's grammar takes `text` and may end after it."""
    assert plan.grammar is not None and plan.grammar.grammar is not None
    grammar = llguidance.LLMatcher.grammar_from_lark(plan.grammar.grammar)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    for t in tok.encode(text, add_special_tokens=False):
        if not matcher.consume_token(t):
            return False
    return matcher.is_accepting()


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_the_grammar_takes_calls_and_nothing_else(
    tokenizer: llguidance.LLTokenizer, smollm2_tokenizer: Any
) -> None:
    weather = call("get_weather", '{"city": "Oslo", "unit": "C"}')
    now = call("now", "{}")
    required = _plan(tools=TOOLS, tool_choice="required")
    single = _plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    named = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    cases = [
        (required, weather, True),
        (required, f"{weather}\n{now}", True),
        (required, "Sure! " + weather, False),  # no text around the calls
        (required, "", False),  # at least one call
        (required, call("get_weather", '{"city": "Oslo"}'), False),  # unit is required
        (required, call("get_weather", '{"city": "Oslo", "unit": "K"}'), False),
        (required, call("delete_all", "{}"), False),
        (required, call("get_weather", '{"city":"Oslo","unit":"C"}'), False),  # the JSON style
        (single, weather, True),
        (single, f"{weather}\n{now}", False),
        (named, now, True),
        (named, weather, False),
    ]
    for plan, text, expected in cases:
        assert _accepts(plan, tokenizer, smollm2_tokenizer, text) is expected, (plan.mode, text)


def test_the_grammar_names_the_added_tokens_of_its_markers() -> None:
    """Where the tokenizer has `<tool_call>` / `</tool_call>` as added tokens (Qwen2.5), the
    grammar takes each as the token or as its text (tests/models/test_real_gguf.py runs it)."""
    body = ChatCompletionRequest.model_validate(
        {"messages": [], "tools": TOOLS, "tool_choice": "required"}
    )
    added = {"<tool_call>": 151657, "</tool_call>": 151658, "<|im_end|>": 151645}
    aware = tool_plan(body, False, None, added).grammar
    plain = tool_plan(body, False, None).grammar
    assert aware is not None and aware.grammar is not None
    assert plain is not None and plain.grammar is not None
    assert '("<tool_call>" | <tool_call>)' in aware.grammar
    assert '("</tool_call>" | </tool_call>)' in aware.grammar
    assert "| <" not in plain.grammar
    assert not llguidance.LLMatcher.validate_grammar(
        llguidance.LLMatcher.grammar_from_lark(aware.grammar)
    )
