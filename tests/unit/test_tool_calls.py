"""Tool calls in the Hermes format (client/tool_calls.py): parsing an output whole or streamed in
pieces gives the same calls and content, rendering tools and calls for a template without them
(SmolLM2's) and for one that has them (arguments as objects)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from pagoda.client.tokenizer import apply_chat_template
from pagoda.client.tool_calls import (
    ToolCallStream,
    hermes_conversation,
    parse_tool_calls,
    template_conversation,
    tools_block,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

# (output, content, [(name, arguments)])
CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    ("Hello there.\n", "Hello there.\n", []),
    ("", None, []),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (  # content before, two calls, braces and quotes inside strings, arguments second
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": [1, {"a": "}\\"{"}]}}\n'
        '</tool_call>\n<tool_call>\n{"arguments": {"q": 1}, "name": "s"}\n</tool_call>\n',
        "Sure.",
        [("f", '{"x": [1, {"a": "}\\"{"}]}'), ("s", '{"q": 1}')],
    ),
    (  # arguments as JSON text, compact JSON, "parameters" for "arguments"
        '<tool_call>{"name":"f","arguments":"{\\"a\\": 1}"}</tool_call>'
        '<tool_call>{"name":"g","parameters":{"b":2}}</tool_call>',
        None,
        [("f", '{"a": 1}'), ("g", '{"b": 2}')],
    ),
    (  # a block that is no call stays content, tags included
        "<tool_call>\nnot json\n</tool_call> after",
        "<tool_call>\nnot json\n</tool_call> after",
        [],
    ),
    ('<tool_call>\n{"name": "f"}\n</tool_call>', '<tool_call>\n{"name": "f"}\n</tool_call>', []),
    (  # cut off by max_tokens inside the arguments: the call keeps what came
        '<tool_call>\n{"name": "f", "arguments": {"a": 1',
        None,
        [("f", '{"a": 1')],
    ),
    ("text <tool_ca", "text <tool_ca", []),  # a tag's beginning held back, then flushed
    ("a < b and c <tool", "a < b and c <tool", []),
    ('Use "<tool_call>" tags.', 'Use "<tool_call>" tags.', []),  # unterminated, no call: content
]


def _streamed(text: str, rng: random.Random) -> tuple[str | None, list[tuple[str, str]]]:
    stream = ToolCallStream()
    content = ""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    ids: dict[int, str] = {}
    i = 0
    while True:
        k = rng.randint(1, 6)
        final = i + k >= len(text)
        piece, deltas = stream.feed(text[i : i + k], final=final)
        i += k
        content += piece
        for d in deltas:
            if d.id is not None:
                assert d.index not in ids, "a call is announced once"
                assert d.name is not None
                ids[d.index], names[d.index] = d.id, d.name
            assert d.index in ids, "pieces of arguments come after the call's id and name"
            args[d.index] = args.get(d.index, "") + d.arguments
        if final:
            break
    assert [c.id for c in stream.calls] == [ids[j] for j in sorted(ids)]
    return content or None, [(names[j], args.get(j, "")) for j in sorted(names)]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_whole_and_streamed_parse_agree(
    text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls)
    rng = random.Random(0)
    for _ in range(30):
        assert _streamed(text, rng) == (content, calls)


def test_whitespace_before_a_call_is_held_back_while_streaming() -> None:
    stream = ToolCallStream()
    assert stream.feed("Let me check.\n\n") == ("Let me check.", [])
    content, deltas = stream.feed('<tool_call>\n{"name": "f", "arguments": {')
    assert content == ""
    assert [(d.name, d.arguments) for d in deltas] == [("f", "{")]
    assert stream.feed("}}\n</tool_call>\n", final=True)[1][0].arguments == "}"
    # and whitespace before plain text is sent once the text shows up
    stream = ToolCallStream()
    assert stream.feed("one\n") == ("one", [])
    assert stream.feed("two") == ("\ntwo", [])


def test_hermes_conversation_for_a_template_without_tools() -> None:
    conversation: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "25C"},
    ]
    out = hermes_conversation(conversation, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER) in out[0]["content"]
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    assert out[3]["content"] == (
        "<tool_response>\n18C\n</tool_response>\n<tool_response>\n25C\n</tool_response>"
    )
    assert all(set(m) == {"role", "content"} for m in out)
    # no system message: one is made for the tools
    first = hermes_conversation([{"role": "user", "content": "hi"}], [WEATHER])[0]
    assert first == {"role": "system", "content": tools_block([WEATHER])}


def test_smollm2_template_gets_the_tools_in_its_system_prompt(smollm2_tokenizer: Any) -> None:
    conversation = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
        },
        {"role": "tool", "content": "-3C"},
    ]
    text = apply_chat_template(smollm2_tokenizer, conversation, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "get_weather"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Oslo"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n-3C\n'
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text
    # without tools the template is used as it is
    plain = apply_chat_template(smollm2_tokenizer, [{"role": "user", "content": "hi"}])
    assert "# Tools" not in plain and "SmolLM" in plain


def test_a_template_with_tools_renders_them_itself(smollm2_tokenizer: Any) -> None:
    template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments.city }}{% endfor %}{{ '\\n' }}{% endfor %}"
    )
    conversation = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
        },
    ]
    text = apply_chat_template(smollm2_tokenizer, conversation, template, False, tools=[WEATHER])
    assert text == "TOOL get_weather\nuser: Weather?\nassistant: CALL get_weather Oslo\n"
    # the caller's messages are not changed
    assert conversation[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert template_conversation(conversation)[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Oslo"
    }
