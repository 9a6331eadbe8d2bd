"""The streamed /v1/messages and /v1/responses events of an output that thinks, then answers
(`--reasoning-parser qwen3`), over a fake engine: the thinking block or reasoning item comes
first and closes where the answer begins. (tests/server/test_reasoning.py runs them on a real
server, where a random model's greedy output never closes its thinking.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.server.messages_stream import message_events
from pagoda.server.reasoning import Reasoning
from pagoda.server.response_events import stream_events
from pagoda.server.responses_protocol import ResponseObject

END_ID = 7
PIECES = [("I th", [1]), ("ink</th", [2]), ("ink>Hi", [END_ID]), (" there", [3])]


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        assert text == "</think>"
        return [END_ID]


class FakeEngine:
    async def outputs(self, stream: Any, delta: bool = False) -> AsyncIterator[RequestOutput]:
        assert delta
        for i, (text, ids) in enumerate(PIECES):
            last = i == len(PIECES) - 1
            c = CompletionOutput(0, text, ids, None, None, "stop" if last else None)
            yield RequestOutput("r", None, [5, 6], None, [c], last)


def _events(stream: AsyncIterator[str]) -> list[dict[str, Any]]:
    async def read() -> list[str]:
        return [e async for e in stream]

    return [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(read())]


def _stream() -> Any:
    return SimpleNamespace(state=SimpleNamespace(prompt_token_ids=[5, 6]))


def test_a_message_streams_its_thinking_then_its_text() -> None:
    state: Any = SimpleNamespace(engine=FakeEngine(), model_name="m")
    reasoning = Reasoning("qwen3", "<think>", FakeTokenizer())
    events = _events(message_events(state, "msg_1", "m", False, _stream(), reasoning))
    shown = [
        (e["type"], e.get("index"), e.get("delta", e.get("content_block")))
        for e in events
        if e["type"].startswith("content_block") or e["type"] == "ping"
    ]
    assert shown == [
        ("content_block_start", 0, {"type": "thinking", "thinking": "", "signature": ""}),
        ("ping", None, None),
        ("content_block_delta", 0, {"type": "thinking_delta", "thinking": "I th"}),
        ("content_block_delta", 0, {"type": "thinking_delta", "thinking": "ink"}),
        ("content_block_delta", 0, {"type": "signature_delta", "signature": ""}),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, {"type": "text", "text": ""}),
        ("content_block_delta", 1, {"type": "text_delta", "text": "Hi"}),
        ("content_block_delta", 1, {"type": "text_delta", "text": " there"}),
        ("content_block_stop", 1, None),
    ]
    assert events[-2]["usage"] == {"output_tokens": 4}


def test_a_response_streams_its_reasoning_item_then_its_message() -> None:
    reasoning = Reasoning("qwen3", "<think>", FakeTokenizer())
    base = ResponseObject(id="resp_1", status="in_progress", model="m")
    kept: list[ResponseObject] = []
    stream = stream_events(FakeEngine(), _stream(), False, base, kept.append, reasoning)  # type: ignore[arg-type]
    events = _events(stream)
    shown = [(e["type"], e.get("output_index"), e.get("delta", e.get("text"))) for e in events]
    assert shown[2:-1] == [
        ("response.output_item.added", 0, None),
        ("response.content_part.added", 0, None),
        ("response.reasoning_text.delta", 0, "I th"),
        ("response.reasoning_text.delta", 0, "ink"),
        ("response.reasoning_text.done", 0, "I think"),
        ("response.content_part.done", 0, None),
        ("response.output_item.done", 0, None),
        ("response.output_item.added", 1, None),
        ("response.content_part.added", 1, None),
        ("response.output_text.delta", 1, "Hi"),
        ("response.output_text.delta", 1, " there"),
        ("response.output_text.done", 1, "Hi there"),
        ("response.content_part.done", 1, None),
        ("response.output_item.done", 1, None),
    ]
    [response] = kept
    assert events[-1]["response"] == response.model_dump()
    thought, message = response.model_dump()["output"]
    assert thought["type"] == "reasoning" and thought["id"].startswith("rs_")
    assert (thought["summary"], thought["status"]) == ([], "completed")
    assert thought["content"] == [{"type": "reasoning_text", "text": "I think"}]
    assert message["content"][0]["text"] == "Hi there" and message["status"] == "completed"
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens == 3
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    assert events[7]["part"] == {"type": "reasoning_text", "text": "I think"}
