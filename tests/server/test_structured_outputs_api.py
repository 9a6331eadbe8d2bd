"""Structured outputs and tools through the OpenAI server on SmolLM2: OpenAI's response_format
(json_object, json_schema), the official client's beta.chat.completions.parse with a pydantic
model, vLLM's structured_outputs field on /v1/completions (streamed too); tools with tool_choice
"required" and a named function (enforced by the grammar), "auto" and "none", tool calls whole
and streamed, a tool call round trip with the official client; a bad schema, regex or tool as a
400 in OpenAI's shape, naming its field, before anything is queued."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import ServerProcess


class City(BaseModel):
    name: str = Field(max_length=20)
    country: Literal["France", "Germany", "Italy", "Spain"]
    population_millions: int = Field(ge=0, le=50)


TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "maxLength": 30}},
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def _finished(server: ServerProcess) -> float:
    """Requests finished so far, every finish reason."""
    lines = server.get("/metrics").text.splitlines()
    return sum(
        float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("pagoda:request_success_total{")
    )


def _model(server: ServerProcess) -> str:
    return str(server.get("/v1/models").json()["data"][0]["id"])


def test_openai_parse_with_a_pydantic_model(smollm2_server: ServerProcess) -> None:
    client = smollm2_server.client()
    completion = client.beta.chat.completions.parse(
        model=_model(smollm2_server),
        messages=[{"role": "user", "content": "Tell me about Paris as JSON."}],
        response_format=City,
        max_tokens=80,
        temperature=1.0,
        seed=0,
        n=2,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        city = choice.message.parsed
        assert isinstance(city, City)
        assert city == City.model_validate_json(choice.message.content or "")


def test_response_format_json_object_and_schema(smollm2_server: ServerProcess) -> None:
    schema = {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "why": {"type": "string", "maxLength": 20},
        },
        "required": ["answer", "why"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
    for fmt in (
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
    ):
        r = smollm2_server.post(
            "/v1/chat/completions",
            {
                "messages": messages,
                "response_format": fmt,
                "max_tokens": 200,
                "temperature": 1.0,
                "seed": 1,
            },
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        value = json.loads(choice["message"]["content"])
        assert isinstance(value, dict)
        if fmt["type"] == "json_schema":
            jsonschema.validate(value, schema)


def test_structured_outputs_field_on_completions_streamed(smollm2_server: ServerProcess) -> None:
    pattern = r"[0-9]{3}-[0-9]{4}"
    body = {
        "prompt": "A phone number:",
        "max_tokens": 20,
        "temperature": 1.0,
        "seed": 2,
        "structured_outputs": {"regex": pattern},
    }
    plain = smollm2_server.post("/v1/completions", body).json()["choices"][0]
    assert re.fullmatch(pattern, plain["text"]) and plain["finish_reason"] == "stop"
    client = smollm2_server.client()
    stream = client.completions.create(
        model=_model(smollm2_server),
        prompt=body["prompt"],
        max_tokens=20,
        temperature=1.0,
        seed=2,
        stream=True,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == plain["text"]  # the same seed: the same tokens, streamed or not
    choice = smollm2_server.post(
        "/v1/completions",
        {**body, "structured_outputs": {"choice": ["red", "green"]}, "seed": 3},
    ).json()["choices"][0]
    assert choice["text"] in ("red", "green")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{nope"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": _named("nope")}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
    ],
)
def test_a_bad_grammar_is_a_400_naming_its_field(
    smollm2_server: ServerProcess, extra: dict[str, object], param: str
) -> None:
    before = _finished(smollm2_server)
    messages = [{"role": "user", "content": "hi"}]
    r = smollm2_server.post(
        "/v1/chat/completions", {"messages": messages, "max_tokens": 4, **extra}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["message"]
    with pytest.raises(openai.BadRequestError):
        smollm2_server.client().chat.completions.create(
            model=_model(smollm2_server),
            messages=messages,
            max_tokens=4,
            extra_body=extra,  # type: ignore[arg-type]
        )
    assert _finished(smollm2_server) == before  # nothing was queued


def _chat(server: ServerProcess, **fields: Any) -> dict[str, Any]:
    r = server.post("/v1/chat/completions", {"messages": WEATHER, "tools": TOOLS, **fields})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _valid_calls(calls: list[dict[str, Any]]) -> int:
    """How many calls there are, each checked against its function's schema."""
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
    return len(calls)


def test_required_tool_calls_follow_the_schemas(smollm2_server: ServerProcess) -> None:
    out = _chat(
        smollm2_server, tool_choice="required", temperature=1.0, seed=4, n=3, max_tokens=120
    )
    checked = 0
    for choice in out["choices"]:
        # parallel calls: the model may go on calling until max_tokens cuts the last call
        calls = choice["message"]["tool_calls"]
        assert choice["finish_reason"] in ("tool_calls", "length"), choice
        assert choice["message"]["content"] is None and calls
        checked += _valid_calls(calls if choice["finish_reason"] == "tool_calls" else calls[:-1])
    assert checked >= 3
    single = _chat(
        smollm2_server,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=5,
        n=2,
        max_tokens=120,
    )
    for choice in single["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        assert len(choice["message"]["tool_calls"]) == 1
        _valid_calls(choice["message"]["tool_calls"])


def test_a_named_function_is_the_one_called(smollm2_server: ServerProcess) -> None:
    out = _chat(smollm2_server, tool_choice=_named("search"), temperature=1.0, seed=6, n=2)
    for choice in out["choices"]:
        assert choice["finish_reason"] == "stop"  # as OpenAI answers a named tool_choice
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "search"
        _valid_calls([call])


def test_streamed_tool_calls_equal_the_whole_ones(smollm2_server: ServerProcess) -> None:
    fields: dict[str, Any] = {"tool_choice": "required", "temperature": 1.0, "seed": 7}
    whole = _chat(smollm2_server, max_tokens=120, **fields)["choices"][0]
    stream = smollm2_server.client().chat.completions.create(
        model=_model(smollm2_server),
        messages=WEATHER,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=120,
        stream=True,
        **fields,
    )
    content, finish, calls = _streamed(stream)
    assert finish == "tool_calls" and content == ""
    expected = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in whole["message"]["tool_calls"]
    ]
    assert calls == expected


def _streamed(stream: Any) -> tuple[str, str | None, list[dict[str, str]]]:
    """A streamed chat's (content, finish_reason, calls), each call's name and arguments put
    together from its pieces in index order."""
    calls: dict[int, dict[str, str]] = {}
    content, finish = "", None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or ():
            if d.id is not None:  # the first piece of a call: its id, type and name
                assert d.index not in calls and d.type == "function" and d.function
                calls[d.index] = {"name": d.function.name or "", "arguments": ""}
            assert d.function is not None
            calls[d.index]["arguments"] += d.function.arguments or ""
    return content, finish, [calls[i] for i in sorted(calls)]


def test_a_tool_call_round_trip_with_the_openai_client(smollm2_server: ServerProcess) -> None:
    client = smollm2_server.client()
    model = _model(smollm2_server)
    first = client.chat.completions.create(
        model=model,
        messages=WEATHER,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=_named("get_weather"),  # type: ignore[arg-type]
        temperature=0.0,
        max_tokens=60,
    )
    message = first.choices[0].message
    [call] = message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS["get_weather"])
    result = json.dumps({"city": arguments["city"], "temperature": 18, "sky": "cloudy"})
    messages: list[Any] = [
        *WEATHER,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    second = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        temperature=0.0,
        max_tokens=40,
    )
    answer = second.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")
    # the call and its result are in the second prompt, in the template's tool format
    template = smollm2_server.post("/tokenize", {"messages": messages, "tools": TOOLS}).json()
    assert second.usage is not None and second.usage.prompt_tokens == template["count"]
    text = smollm2_server.post("/detokenize", {"tokens": template["tokens"]}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": ' in text
    assert f"<tool_response>\n{result}\n</tool_response>" in text


# One earlier turn where the assistant called get_weather: SmolLM2-135M then calls it by itself
# for the next city, greedily, under tool_choice "auto" (asked cold, it answers in text).
ONE_SHOT: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in Berlin?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": json.dumps({"city": "Berlin", "unit": "celsius"}),
                },
            }
        ],
    },
    *WEATHER,
]


def test_auto_parses_the_calls_the_model_writes_whole_and_streamed(
    smollm2_server: ServerProcess,
) -> None:
    fields = {"messages": ONE_SHOT, "tools": TOOLS, "tool_choice": "auto", "temperature": 0.0}
    r = smollm2_server.post("/v1/chat/completions", {**fields, "max_tokens": 60})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert _valid_calls([call]) == 1 and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] == "Paris"
    stream = smollm2_server.client().chat.completions.create(
        model=_model(smollm2_server), max_tokens=60, stream=True, **fields
    )
    content, finish, calls = _streamed(stream)
    assert finish == "tool_calls" and content == ""
    assert calls == [{"name": "get_weather", "arguments": call["function"]["arguments"]}]
    # "none": the same greedy text, the call left unparsed in the content
    none = _chat(smollm2_server, **(fields | {"tool_choice": "none"}), max_tokens=60)["choices"][0]
    assert none["message"]["tool_calls"] == [] and none["finish_reason"] == "stop"
    assert none["message"]["content"].startswith('<tool_call>\n{"name": "get_weather"')


def test_auto_and_none_leave_a_text_answer_alone(smollm2_server: ServerProcess) -> None:
    plain = smollm2_server.post(
        "/v1/chat/completions", {"messages": WEATHER, "max_tokens": 24, "temperature": 0.0}
    ).json()["choices"][0]
    for choice in ("auto", "none"):
        out = _chat(smollm2_server, tool_choice=choice, max_tokens=24, temperature=0.0)
        c = out["choices"][0]
        # SmolLM2-135M answers this one in text: content, no calls
        assert "<tool_call>" not in c["message"]["content"] and c["message"]["tool_calls"] == []
        assert c["finish_reason"] in ("stop", "length")
    assert plain["message"]["tool_calls"] == []


def test_a_token_its_grammar_refuses_is_an_error_not_a_stop(
    smollm2_server: ServerProcess,
) -> None:
    """The grammar asks for the text of an added token (SmolLM2's "<repo_name>", id 3):
    llguidance's mask lets the token itself through, then refuses it. The request must not end
    as a normal "stop" with a cut output: a 500 in OpenAI's shape, whole or streamed, and the
    server goes on serving."""
    body = {
        "prompt": "Say hi:",
        "max_tokens": 8,
        "temperature": 0.0,
        "structured_outputs": {"grammar": 'start: "<repo_name>" "x"'},
    }
    r = smollm2_server.post("/v1/completions", body)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == 500 and "grammar" in error["message"]
    url, streamed_body = smollm2_server.url + "/v1/completions", {**body, "stream": True}
    with httpx.stream("POST", url, json=streamed_body, headers=smollm2_server.headers) as events:
        assert events.status_code == 200  # the headers went before the error was known
        lines = [line for line in events.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    streamed = json.loads(lines[-2][len("data: ") :])
    assert streamed["error"]["code"] == 500 and "grammar" in streamed["error"]["message"]
    fine = {**body, "structured_outputs": {"grammar": 'start: ("<repo_name>" | <repo_name>) "x"'}}
    r = smollm2_server.post("/v1/completions", fine)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text
