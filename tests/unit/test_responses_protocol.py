"""The Responses API's request as the chat request it is served as (server/responses_protocol.py),
a response's output as the message that continues it (server/response_output.py), and the bound
of the response store (server/response_store.py): exact messages, exact eviction order."""

from __future__ import annotations

from typing import Any

from pagoda.client.tool_calls import ToolCall
from pagoda.server.protocol import ChatMessage
from pagoda.server.response_output import as_message, finished, output_items
from pagoda.server.response_store import ResponseStore, StoredResponse
from pagoda.server.responses_protocol import ResponseObject, ResponsesRequest

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'}


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    request = ResponsesRequest.model_validate(body)
    chat = request.chat_request(request.input_messages())
    return [m.model_dump(exclude_none=True) for m in chat.messages]


def test_text_input_is_one_user_message_after_the_instructions() -> None:
    assert _messages({"input": "hi", "instructions": "be brief"}) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]


def test_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "a"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        CALL,
        {**CALL, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2", "output": "two"},
        CALL,  # a call with no assistant text before it makes its own message
    ]
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        for i in (1, 2)
    ]
    assert _messages({"input": items}) == [
        {"role": "developer", "content": "a"},
        {"role": "assistant", "content": "b", "tool_calls": calls},
        {"role": "tool", "content": "one", "tool_call_id": "call_1"},
        {"role": "tool", "content": "two", "tool_call_id": "call_2"},
        {"role": "assistant", "tool_calls": calls[:1]},
    ]


def test_tools_text_format_and_sampling_fields_carry_over() -> None:
    body = {
        "input": "hi",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "max_output_tokens": 7,
        "temperature": 0.5,
        "seed": 3,
        "top_k": 2,
    }
    request = ResponsesRequest.model_validate(body)
    chat = request.chat_request(request.input_messages())
    assert [t.model_dump(exclude_none=True) for t in chat.tools or []] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert chat.tool_choice is not None and not isinstance(chat.tool_choice, str)
    assert chat.tool_choice.function.name == "f"
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}},
    }
    assert (chat.max_tokens, chat.temperature, chat.seed, chat.top_k) == (7, 0.5, 3, 2)
    assert request.grammar_field == "text.format"


def test_an_output_continues_as_the_message_its_items_replay_as() -> None:
    calls = [ToolCall("call_1", "f", '{"a": 1}')]
    items = output_items("b", calls, "stop")
    assert [(i.type, i.status) for i in items] == [
        ("message", "completed"),
        ("function_call", "completed"),
    ]
    replayed = ResponsesRequest.model_validate(
        {"input": [i.model_dump() for i in items]}
    ).input_messages()
    assert replayed == [as_message(items)]
    assert output_items("", calls, "length")[-1].status == "incomplete"
    assert [i.type for i in output_items("", [], "stop")] == ["message"]


def _stored(rid: str) -> StoredResponse:
    base = ResponseObject(id=rid, status="in_progress", model="m")
    response = finished(base, output_items("x", [], "length"), "length", 5, 3, 2)
    return StoredResponse(response, [ChatMessage(role="user", content=rid)])


def test_finished_response_usage_and_status() -> None:
    response = _stored("r").response
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.usage is not None
    assert response.usage.model_dump() == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 8,
    }


def test_the_store_drops_the_least_recently_used_past_its_bound() -> None:
    store = ResponseStore(max_count=3)
    for rid in ("a", "b", "c"):
        store.put(_stored(rid))
    assert store.get("a") is not None  # a is used: b is now the oldest
    store.put(_stored("d"))
    assert len(store) == 3 and store.get("b") is None
    assert [rid for rid in "acd" if store.get(rid) is not None] == ["a", "c", "d"]
    store.put(_stored("e"))  # a, then c and d were read in that order: a goes
    assert store.get("a") is None and len(store) == 3
    assert store.delete("c") and not store.delete("c") and len(store) == 2
