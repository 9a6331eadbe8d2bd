"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) with the official
`anthropic` client, on the session's tiny random Llama server.

The oracle is /v1/chat/completions: a greedy message equals the greedy chat completion of the
same conversation (system, text blocks, tool_use and tool_result turns, a named tool), token for
token, and count_tokens equals /tokenize of it. Also: stop_sequences, max_tokens, the stream's
events in Anthropic's order, tool_use blocks valid under their input_schema, Anthropic's error
shape for bad input (a 400 naming the field, nothing queued) and the x-api-key header (one
server with --api-key).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.conftest import SMALL_POOL, ServerProcess

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER_SCHEMA,
}
OPENAI_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER_SCHEMA,
    },
}
SYSTEM = "You are a terse assistant."
QUESTION = "What is the weather in Paris?"
# anthropic 2.x's client has no sampling arguments left: temperature, top_p, top_k go in the body
GREEDY: dict[str, Any] = {"max_tokens": 12, "extra_body": {"temperature": 0.0}}
CHAT_GREEDY = {"temperature": 0.0, "max_tokens": 12}


def _client(server: ServerProcess, api_key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0)


def _model(server: ServerProcess) -> str:
    return str(server.get("/v1/models").json()["data"][0]["id"])


def _chat(server: ServerProcess, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    r = server.post("/v1/chat/completions", {"messages": messages, **CHAT_GREEDY, **fields})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _finished(server: ServerProcess) -> float:
    lines = server.get("/metrics").text.splitlines()
    return sum(
        float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("pagoda:request_success_total{")
    )


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_equals_the_greedy_chat_completion(tiny_server: ServerProcess) -> None:
    message = _client(tiny_server).messages.create(
        model=_model(tiny_server),
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
        **GREEDY,
    )
    chat = _chat(
        tiny_server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    )
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "length"
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == _model(tiny_server)
    assert [b.type for b in message.content] == ["text"]
    assert _text(message) == choice["message"]["content"]
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"] == 12


def test_blocks_and_an_assistant_turn_equal_the_chat(tiny_server: ServerProcess) -> None:
    message = _client(tiny_server).messages.create(
        model=_model(tiny_server),
        system=[{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi. "}, {"type": "text", "text": "Count."}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "One, two"}]},
            {"role": "user", "content": "Go on."},
        ],
        **GREEDY,
    )
    chat = _chat(
        tiny_server,
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi. Count."},
            {"role": "assistant", "content": "One, two"},
            {"role": "user", "content": "Go on."},
        ],
    )
    assert _text(message) == chat["choices"][0]["message"]["content"]
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_stop_sequences(tiny_server: ServerProcess) -> None:
    client = _client(tiny_server)
    messages = [{"role": "user", "content": QUESTION}]
    whole = _text(client.messages.create(model=_model(tiny_server), messages=messages, **GREEDY))
    middle = len(whole) // 2
    stop = whole[middle : middle + 3]
    assert stop.strip(), whole
    message = client.messages.create(
        model=_model(tiny_server), messages=messages, stop_sequences=["\x00never", stop], **GREEDY
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert _text(message) == whole[: whole.index(stop)]


def test_stream_events_in_anthropic_order(tiny_server: ServerProcess) -> None:
    client = _client(tiny_server)
    request: dict[str, Any] = {
        "model": _model(tiny_server),
        "system": SYSTEM,
        "messages": [{"role": "user", "content": QUESTION}],
        **GREEDY,
    }
    whole = client.messages.create(**request)
    kinds, deltas = [], []
    with client.messages.stream(**request) as stream:
        for event in stream:
            if event.type in ("text", "input_json"):  # the helper's own events
                continue
            kinds.append(event.type)
            if event.type == "content_block_delta":
                assert event.index == 0 and event.delta.type == "text_delta"
                deltas.append(event.delta.text)
        final = stream.get_final_message()
    n = len(deltas)
    assert n >= 1
    assert kinds == [  # the client drops the ping (test_stream_wire_format sees it)
        "message_start",
        "content_block_start",
        *["content_block_delta"] * n,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(deltas) == _text(final) == _text(whole)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_stream_wire_format(tiny_server: ServerProcess) -> None:
    body = {"model": _model(tiny_server), "messages": [{"role": "user", "content": "hi"}]}
    body.update(CHAT_GREEDY, stream=True, max_tokens=3)
    r = tiny_server.post("/v1/messages", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    kinds = [e.split("\n")[0] for e in events]
    assert kinds[:3] == ["event: message_start", "event: content_block_start", "event: ping"]
    assert kinds[-3:] == [
        "event: content_block_stop",
        "event: message_delta",
        "event: message_stop",
    ]
    assert set(kinds[3:-3]) == {"event: content_block_delta"}
    for event in events:
        name, data = event.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[len("data: ") :])["type"] == name[len("event: ") :]
    last = [json.loads(e.split("\n")[1][6:]) for e in events[-2:]]
    assert last[0]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert last[0]["usage"] == {"output_tokens": 3} and last[1] == {"type": "message_stop"}


def _tool_turns() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A tool round trip, in Anthropic's blocks and in OpenAI's messages."""
    call = {"city": "Paris", "unit": "celsius"}
    anthropic_turns = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": call},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "18 C, sunny"},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ]
    openai_turns = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_01",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(call)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_01", "content": "18 C, sunny"},
        {"role": "user", "content": "Thanks."},
    ]
    return anthropic_turns, openai_turns


def test_count_tokens_equals_tokenize(tiny_server: ServerProcess) -> None:
    client = _client(tiny_server)
    turns, openai_turns = _tool_turns()
    counted = client.messages.count_tokens(
        model=_model(tiny_server), system=SYSTEM, messages=turns, tools=[TOOL]
    )
    system = [{"role": "system", "content": SYSTEM}]
    r = tiny_server.post("/tokenize", {"messages": system + openai_turns, "tools": [OPENAI_TOOL]})
    assert counted.input_tokens == r.json()["count"]
    plain = client.messages.count_tokens(
        model=_model(tiny_server), messages=[{"role": "user", "content": QUESTION}]
    )
    r = tiny_server.post("/tokenize", {"messages": [{"role": "user", "content": QUESTION}]})
    assert plain.input_tokens == r.json()["count"] < counted.input_tokens
    message = client.messages.create(
        model=_model(tiny_server), messages=[{"role": "user", "content": QUESTION}], **GREEDY
    )
    assert message.usage.input_tokens == plain.input_tokens


def test_a_tool_result_turn_equals_the_chat(tiny_server: ServerProcess) -> None:
    turns, openai_turns = _tool_turns()
    message = _client(tiny_server).messages.create(
        model=_model(tiny_server),
        messages=turns,
        tools=[TOOL],
        tool_choice={"type": "none"},
        **GREEDY,
    )
    chat = _chat(tiny_server, openai_turns, tools=[OPENAI_TOOL], tool_choice="none")
    assert _text(message) == chat["choices"][0]["message"]["content"]
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_a_named_tool_is_a_valid_tool_use_block(tiny_server: ServerProcess) -> None:
    client = _client(tiny_server)
    request: dict[str, Any] = {
        "model": _model(tiny_server),
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "extra_body": {"temperature": 0.0},
        "max_tokens": 120,
    }
    message = client.messages.create(**request)
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["tool_use"]
    block = message.content[0]
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("toolu_") and len(block.id) > len("toolu_")
    jsonschema.validate(block.input, WEATHER_SCHEMA)
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat = _chat(
        tiny_server, request["messages"], tools=[OPENAI_TOOL], tool_choice=named, max_tokens=120
    )
    (call,) = chat["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == block.input
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
    kinds, pieces = [], []
    with client.messages.stream(**request) as stream:
        for event in stream:
            if event.type in ("text", "input_json"):
                continue
            kinds.append(event.type)
            if event.type == "content_block_start":
                assert event.content_block.type == "tool_use"
                assert event.content_block.name == "get_weather"
            if event.type == "content_block_delta":
                assert event.delta.type == "input_json_delta"
                pieces.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert json.loads("".join(pieces)) == block.input
    assert final.stop_reason == "tool_use" and final.content[0].input == block.input


def _error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    return str(body["error"]["message"])


BASE: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content.0"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages.0.content.0"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}
                ]
            },
            "messages.0.content.0.input",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}],
                    }
                ]
            },
            "messages.0.content.0",
        ),
        ({"temperature": -1}, "temperature"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"tools": [{"name": "a b", "input_schema": {}}]}, "tools.0.name"),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"stop_sequences": "x"}, "stop_sequences"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    tiny_server: ServerProcess, change: dict[str, Any], field: str
) -> None:
    before = _finished(tiny_server)
    body = {"model": _model(tiny_server), **BASE, **change}
    body = {k: v for k, v in body.items() if v is not None}
    message = _error(tiny_server.post("/v1/messages", body), 400, "invalid_request_error")
    assert message.startswith(field), message
    assert _finished(tiny_server) == before  # nothing was queued


def test_bad_input_through_the_client(tiny_server: ServerProcess) -> None:
    client = _client(tiny_server)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model=_model(tiny_server), messages=[{"role": "user", "content": "hi"}], max_tokens=-1
        )
    assert caught.value.status_code == 400
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(
            model="claude-nope", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=_model(tiny_server), messages="hi")  # type: ignore[arg-type]
    r = tiny_server.post(
        "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert _error(r, 400, "invalid_request_error") == "the request body is not valid JSON"
    _error(tiny_server.post("/v1/messages/nope", {}), 404, "not_found_error")
    openai_shape = tiny_server.post("/v1/chat/completions", {"max_tokens": 1})  # others unchanged
    assert openai_shape.status_code == 400 and openai_shape.json()["error"]["param"] == "messages"


API_KEY = "sk-ant-0123456789"


@pytest.fixture(scope="module")
def keyed_server(tiny_llama_dir: str) -> Iterator[ServerProcess]:
    server = ServerProcess(tiny_llama_dir, SMALL_POOL, api_key=API_KEY).wait_ready()
    yield server
    server.stop()


def test_x_api_key(keyed_server: ServerProcess) -> None:
    model = _model(keyed_server)
    request: dict[str, Any] = {"model": model, **BASE}
    with pytest.raises(anthropic.AuthenticationError) as caught:
        _client(keyed_server, "wrong").messages.create(**request)
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "authentication_error"
    for key in (API_KEY[:-1], API_KEY + "0", "x" + API_KEY[1:]):
        headers = {"x-api-key": key, "Authorization": ""}
        r = httpx.post(keyed_server.url + "/v1/messages", json=request, headers=headers)
        _error(r, 401, "authentication_error")
    _error(
        httpx.post(keyed_server.url + "/v1/messages/count_tokens", json=request),
        401,
        "authentication_error",
    )
    message = _client(keyed_server, API_KEY).messages.create(**request)
    assert message.usage.output_tokens >= 1
    counted = _client(keyed_server, API_KEY).messages.count_tokens(
        model=model, messages=BASE["messages"]
    )
    assert counted.input_tokens == message.usage.input_tokens
    bearer = keyed_server.post("/v1/messages", request)  # Authorization: Bearer works too
    assert bearer.status_code == 200, bearer.text
    # Other routes keep OpenAI's header only.
    r = httpx.get(keyed_server.url + "/v1/models", headers={"x-api-key": API_KEY})
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
