"""Structured outputs through the OpenAI server on SmolLM2: OpenAI's response_format (json_object,
json_schema), the official client's beta.chat.completions.parse with a pydantic model, vLLM's
structured_outputs field on /v1/completions (streamed too), and a bad schema or regex as a 400
in OpenAI's shape, naming its field, before anything is queued."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import ServerProcess


class City(BaseModel):
    name: str = Field(max_length=20)
    country: Literal["France", "Germany", "Italy", "Spain"]
    population_millions: int = Field(ge=0, le=50)


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
