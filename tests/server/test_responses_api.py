"""/v1/responses (OpenAI's Responses API) on the tiny random Llama, driven by the official
`openai` client: text and item input, instructions, max_output_tokens, previous_response_id,
store, retrieve and delete, streamed events, function tools, text.format; bad input as a 400
naming its field with nothing queued.

The oracle: a response is served as the chat completion of the same conversation, so a greedy
response equals the greedy /v1/chat/completions answer exactly, and its usage.input_tokens is
/tokenize's count of that conversation.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import ServerProcess

GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Berlin", "Rome"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": WEATHER_PARAMETERS,
}
CHAT_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {k: v for k, v in TOOL.items() if k != "type"},
}
NAMED = {"type": "function", "name": "get_weather"}
CHAT_NAMED = {"type": "function", "function": {"name": "get_weather"}}
CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "rank": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "rank"],
    "additionalProperties": False,
    # llguidance's: no free whitespace, which the random model would pad the object with forever
    "x-guidance": {"whitespace_flexible": False},
}


@pytest.fixture(scope="module")
def tiny(tiny_server: ServerProcess) -> tuple[ServerProcess, str]:
    return tiny_server, str(tiny_server.get("/v1/models").json()["data"][0]["id"])


def _chat(server: ServerProcess, model: str, messages: list[Any], **fields: Any) -> Any:
    return server.client().chat.completions.create(model=model, messages=messages, **fields)


def _prompt_tokens(server: ServerProcess, messages: list[Any], **fields: Any) -> int:
    return int(server.post("/tokenize", {"messages": messages, **fields}).json()["count"])


def _finished(server: ServerProcess) -> float:
    lines = server.get("/metrics").text.splitlines()
    return sum(
        float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("pagoda:request_success_total{")
    )


# ---- whole responses ---------------------------------------------------------------------------
def test_text_input_equals_the_chat_completion(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    client = server.client()
    r = client.responses.create(
        model=model, input="What is 2 + 2?", instructions="Be terse.", max_output_tokens=8, **GREEDY
    )
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    chat = _chat(server, model, messages, max_tokens=8, **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert isinstance(r.created_at, (int, float))
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    [part] = item.content
    assert part.type == "output_text" and part.annotations == []
    assert part.text == r.output_text == chat.choices[0].message.content
    # cut by max_output_tokens (ignore_eos): incomplete, as OpenAI reports it
    assert chat.choices[0].finish_reason == "length"
    assert r.status == "incomplete" and item.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and chat.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    assert r.usage.total_tokens == chat.usage.prompt_tokens + 8
    assert r.usage.input_tokens == _prompt_tokens(server, messages)
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert isinstance(r.usage.input_tokens_details.cached_tokens, int)
    assert r.instructions == "Be terse." and r.max_output_tokens == 8 and r.temperature == 0.0


def test_item_input_equals_the_chat_completion(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    items: list[Any] = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer briefly."}]},
        {"type": "message", "role": "user", "content": "Hello"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hi there.", "annotations": []}],
        },
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Name a "},
                {"type": "input_text", "text": "color."},
            ],
        },
    ]
    r = server.client().responses.create(model=model, input=items, max_output_tokens=6, **GREEDY)
    messages = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there."},
        {"role": "user", "content": "Name a color."},
    ]
    chat = _chat(server, model, messages, max_tokens=6, **GREEDY)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and r.usage.input_tokens == _prompt_tokens(server, messages)


def test_sampling_fields_carry_over(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    extra = {"seed": 5, "top_k": 20, "ignore_eos": True}
    fields: dict[str, Any] = {"temperature": 1.0, "top_p": 0.9, "extra_body": extra}
    r = server.client().responses.create(
        model=model, input="Pick a word.", max_output_tokens=10, **fields
    )
    messages = [{"role": "user", "content": "Pick a word."}]
    chat = _chat(server, model, messages, max_tokens=10, **fields)
    assert r.output_text == chat.choices[0].message.content
    assert (r.temperature, r.top_p) == (1.0, 0.9)


def test_previous_response_id_continues_the_conversation(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    client = server.client()
    first = client.responses.create(
        model=model, input="Name a color.", instructions="Old rules.", max_output_tokens=5, **GREEDY
    )
    second = client.responses.create(
        model=model,
        input="And another one?",
        instructions="New rules.",
        previous_response_id=first.id,
        max_output_tokens=5,
        **GREEDY,
    )
    # the earlier turn and its answer come before the new input; the earlier instructions do not
    messages = [
        {"role": "system", "content": "New rules."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another one?"},
    ]
    assert second.previous_response_id == first.id
    assert second.usage is not None and second.usage.input_tokens == _prompt_tokens(
        server, messages
    )
    chat = _chat(server, model, messages, max_tokens=5, **GREEDY)
    assert second.output_text == chat.choices[0].message.content
    # a third turn continues the second, which holds the first
    third = client.responses.create(
        model=model, input="Thanks.", previous_response_id=second.id, max_output_tokens=3, **GREEDY
    )
    longer = [
        *messages[1:],
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Thanks."},
    ]
    assert third.usage is not None and third.usage.input_tokens == _prompt_tokens(server, longer)


def test_store_retrieve_and_delete(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    client = server.client()
    kept = client.responses.create(model=model, input="Keep me", max_output_tokens=3, **GREEDY)
    assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    unstored = client.responses.create(
        model=model, input="Forget me", max_output_tokens=3, store=False, **GREEDY
    )
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(unstored.id)
    assert e.value.param == "response_id"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(
            model=model, input="Go on", previous_response_id=unstored.id, max_output_tokens=3
        )
    assert e.value.param == "previous_response_id"
    deleted = server.client().delete(f"/responses/{kept.id}", cast_to=httpx.Response)
    assert deleted.json() == {"id": kept.id, "object": "response.deleted", "deleted": True}
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(kept.id)


# ---- streamed responses ------------------------------------------------------------------------
def _stop_inside(server: ServerProcess, model: str, text_input: str) -> str:
    """A stop string that the greedy answer to `text_input` reaches in its middle."""
    r = server.client().responses.create(
        model=model, input=text_input, max_output_tokens=16, **GREEDY
    )
    text = r.output_text
    middle = len(text) // 2
    stop = text[middle : middle + 3]
    assert stop.strip() and text.index(stop) > 0
    return stop


def test_streamed_events_add_up_to_the_whole_response(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    client = server.client()
    stop = _stop_inside(server, model, "Tell me a story.")
    fields: dict[str, Any] = {
        "model": model,
        "input": "Tell me a story.",
        "max_output_tokens": 16,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True, "stop": [stop]},
    }
    whole = client.responses.create(**fields)
    assert whole.status == "completed" and whole.incomplete_details is None
    with client.responses.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(d.delta for d in deltas)
    assert text == final.output_text == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []  # type: ignore[union-attr]
    item_id = final.output[0].id  # type: ignore[union-attr]
    assert {d.item_id for d in deltas} == {item_id} and {d.output_index for d in deltas} == {0}
    assert final.status == "completed" and final.usage == whole.usage
    strip = {"id", "created_at", "output"}
    assert final.model_dump(exclude=strip) == whole.model_dump(exclude=strip)
    assert client.responses.retrieve(final.id).output_text == text


def test_a_streamed_response_cut_by_max_output_tokens(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    body = {"model": model, "input": "Hi", "max_output_tokens": 4, "temperature": 0.0}
    with httpx.Client(timeout=60) as http:
        raw = http.post(
            server.url + "/v1/responses", json={**body, "ignore_eos": True, "stream": True}
        )
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in raw.text.split("\n\n"):
        if block:
            head, data = block.split("\n")
            payload = json.loads(data.removeprefix("data: "))
            assert head == f"event: {payload['type']}"
            events.append(payload)
    assert "[DONE]" not in raw.text
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["usage"]["output_tokens"] == 4
    [done] = [e for e in events if e["type"] == "response.output_item.done"]
    assert done["item"]["status"] == "incomplete"


# ---- function tools ----------------------------------------------------------------------------
def test_a_function_call_round_trip(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    client = server.client()
    ask = "What is the weather in Paris?"
    r = client.responses.create(
        model=model,
        input=ask,
        tools=[TOOL],
        tool_choice=NAMED,
        max_output_tokens=60,
        temperature=0.0,
    )  # type: ignore[arg-type]
    [call] = r.output
    assert (
        call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    )
    assert call.call_id and call.id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    chat = _chat(
        server, model, [{"role": "user", "content": ask}],
        tools=[CHAT_TOOL], tool_choice=CHAT_NAMED, max_tokens=60, temperature=0.0,
    )  # fmt: skip
    [chat_call] = chat.choices[0].message.tool_calls
    assert call.arguments == chat_call.function.arguments
    # the call's output, after the call, in the next turn
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, cloudy"}
    after = {"tools": [TOOL], "tool_choice": "none", "max_output_tokens": 6, **GREEDY}
    second = client.responses.create(
        model=model, input=[result], previous_response_id=r.id, **after
    )
    messages = [
        {"role": "user", "content": ask},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, cloudy"},
    ]
    n_prompt = _prompt_tokens(server, messages, tools=[CHAT_TOOL])
    assert second.usage is not None and second.usage.input_tokens == n_prompt
    answer = _chat(
        server, model, messages, tools=[CHAT_TOOL], tool_choice="none", max_tokens=6, **GREEDY
    )
    assert second.output_text == answer.choices[0].message.content
    # the same turn with the items sent back by the client instead of previous_response_id
    items = [{"role": "user", "content": ask}, call.model_dump(exclude_none=True), result]
    replayed = client.responses.create(model=model, input=items, **after)
    assert replayed.usage is not None and replayed.usage.input_tokens == n_prompt
    assert replayed.output_text == second.output_text


def test_a_streamed_function_call(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    client = server.client()
    fields: dict[str, Any] = {
        "model": model,
        "input": "Weather in Rome?",
        "tools": [TOOL],
        "tool_choice": NAMED,
        "max_output_tokens": 60,
        "temperature": 0.0,
    }
    whole = client.responses.create(**fields)
    with client.responses.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(deltas),
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    [call] = final.output
    [whole_call] = whole.output
    assert call.type == whole_call.type == "function_call"
    assert "".join(d.delta for d in deltas) == call.arguments == whole_call.arguments
    assert call.name == "get_weather"
    done = events[-3]
    assert done.type == "response.function_call_arguments.done"
    assert done.arguments == call.arguments and done.item_id == call.id


# ---- text.format -------------------------------------------------------------------------------
def test_text_format_json_schema(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    fmt = {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA, "strict": True}
    r = server.client().responses.create(
        model=model,
        input="A city, as JSON.",
        text={"format": fmt},
        max_output_tokens=40,
        temperature=0.0,
    )  # type: ignore[arg-type]
    assert r.status == "completed", repr(r.output_text)
    jsonschema.validate(json.loads(r.output_text), CITY_SCHEMA)
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": CITY_SCHEMA},
    }
    chat = _chat(
        server, model, [{"role": "user", "content": "A city, as JSON."}],
        response_format=response_format, max_tokens=40, temperature=0.0,
    )  # fmt: skip
    assert r.output_text == chat.choices[0].message.content
    assert r.text is not None and r.text.format.type == "json_schema"


# ---- bad input ---------------------------------------------------------------------------------
BAD: list[tuple[dict[str, Any], str]] = [
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role"),
    (
        {"input": [{"type": "function_call_output", "output": "x"}]},
        "input.0.call_id",
    ),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    (
        {"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
        "tool_choice",
    ),
    ({"input": "hi", "tools": [TOOL]}, "tool_choice"),  # "auto" needs --enable-auto-tool-choice
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    (
        {
            "input": "hi",
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}},
        },
        "text.format",
    ),
    ({"input": "hi", "n": 2}, "n"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input.0"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
]


def test_bad_input_is_a_400_naming_the_field(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    before = _finished(server)
    for body, param in BAD:
        r = server.post("/v1/responses", {"model": model, **body})
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert (error["param"], error["type"], error["code"]) == (param, "BadRequestError", 400), (
            body
        )
    r = server.post(
        "/v1/responses", {"model": model, "input": "hi", "previous_response_id": "resp_x"}
    )
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    r = server.post("/v1/responses", {"model": "other", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert _finished(server) == before  # nothing reached the engine
    with pytest.raises(openai.BadRequestError) as e:
        server.client().responses.create(model=model, input="hi", max_output_tokens=0)
    assert e.value.param == "max_output_tokens"
