"""A streamed response (`stream: true` on /v1/responses): OpenAI's typed server-sent events.

Each event is `event: <type>\\ndata: <json>\\n\\n` with a `sequence_number` counting from 0:

    response.created, response.in_progress
    a reasoning item (under --reasoning-parser, where the output thinks; always the first):
                       response.output_item.added, response.content_part.added,
                       response.reasoning_text.delta ..., response.reasoning_text.done,
                       response.content_part.done, response.output_item.done
    per message item:  response.output_item.added, response.content_part.added,
                       response.output_text.delta ..., response.output_text.done,
                       response.content_part.done, response.output_item.done
    per function call: response.output_item.added, response.function_call_arguments.delta ...,
                       response.function_call_arguments.done, response.output_item.done
    response.completed (response.incomplete where max_output_tokens cut it)

The items and the final response are those a whole request gets (response_output.py); the
deltas of an item add up to its final text or arguments. An error once the headers are sent is
one `error` event, and the stream ends (no [DONE], as OpenAI's).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagoda.client.async_client import AsyncEngine, EngineDeadError, RequestStream
from pagoda.client.tool_calls import ToolCallDelta, ToolCallStream
from pagoda.server.generation import GENERATION_ERROR, GenerationError
from pagoda.server.reasoning import Reasoning
from pagoda.server.response_output import (
    call_item,
    finished,
    item_status,
    message_item,
    reasoning_item,
)
from pagoda.server.responses_protocol import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    ResponseObject,
)

logger = logging.getLogger("pagoda.server")


class ResponseEvents:
    """The events of one response's output, item by item; at most one item is open."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def lifecycle(self, kind: str, response: ResponseObject) -> str:
        return self.event(kind, response=response.model_dump())

    def text(self, delta: str) -> list[str]:
        """Events for new message text (opening the message item where none is open)."""
        out = []
        if not isinstance(self._open, OutputMessage):
            out += self.close("completed")
            out += self._add(message_item("", "in_progress"))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self.event("response.content_part.added", **self._at(), part=part))
        message = self._open
        assert isinstance(message, OutputMessage)
        message.content[0].text += delta
        fields = {**self._at(), "delta": delta, "logprobs": []}
        out.append(self.event("response.output_text.delta", **fields))
        return out

    def thought(self, delta: str) -> list[str]:
        """Events for new reasoning text (opening the reasoning item where none is open)."""
        out = []
        if not isinstance(self._open, OutputReasoning):
            out += self.close("completed")
            out += self._add(reasoning_item("", "in_progress"))
            part = {"type": "reasoning_text", "text": ""}
            out.append(self.event("response.content_part.added", **self._at(), part=part))
        item = self._open
        assert isinstance(item, OutputReasoning)
        item.content[0].text += delta
        out.append(self.event("response.reasoning_text.delta", **self._at(), delta=delta))
        return out

    def call(self, delta: ToolCallDelta) -> list[str]:
        """Events for a piece of a tool call (its first piece opens its item)."""
        out = []
        if delta.id is not None:
            out += self.close("completed")
            out += self._add(call_item(delta.id, delta.name or "", "", "in_progress"))
        call = self._open
        assert isinstance(call, OutputFunctionCall)
        if delta.arguments:
            call.arguments += delta.arguments
            fields = {"item_id": call.id, "output_index": len(self.items) - 1}
            out.append(
                self.event(
                    "response.function_call_arguments.delta", **fields, delta=delta.arguments
                )
            )
        return out

    def close(self, status: str) -> list[str]:
        """Events that finish the open item, if any, with `status`."""
        item, self._open = self._open, None
        if item is None:
            return []
        out = []
        at = {"item_id": item.id, "output_index": len(self.items) - 1}
        if isinstance(item, (OutputMessage, OutputReasoning)):
            part = item.content[0]
            done = {**at, "content_index": 0, "text": part.text}
            if isinstance(item, OutputMessage):
                kind = "response.output_text.done"
                done["logprobs"] = []
            else:
                kind = "response.reasoning_text.done"
            out.append(self.event(kind, **done))
            fields = {**at, "content_index": 0, "part": part.model_dump()}
            out.append(self.event("response.content_part.done", **fields))
        else:
            done = {**at, "name": item.name, "arguments": item.arguments}
            out.append(self.event("response.function_call_arguments.done", **done))
        item.status = status  # type: ignore[assignment]
        out.append(self._item_event("response.output_item.done", item))
        return out

    def _add(self, item: OutputItem) -> list[str]:
        self.items.append(item)
        self._open = item
        return [self._item_event("response.output_item.added", item)]

    def _item_event(self, kind: str, item: OutputItem) -> str:
        index = self.items.index(item)
        return self.event(kind, output_index=index, item=item.model_dump())

    def _at(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.id, "output_index": len(self.items) - 1, "content_index": 0}


async def stream_events(
    engine: AsyncEngine,
    stream: RequestStream,
    parse_calls: bool,
    base: ResponseObject,
    keep: Callable[[ResponseObject], None],
    reasoning: Reasoning | None = None,
    skip_special: bool = True,
) -> AsyncIterator[str]:
    """The events of one request's output; `keep` gets the finished response; `reasoning`
    splits the thinking off (under --reasoning-parser)."""
    events = ResponseEvents()
    yield events.lifecycle("response.created", base)
    yield events.lifecycle("response.in_progress", base)
    calls = ToolCallStream() if parse_calls else None
    output_tokens = cached = 0
    finish_reason: str | None = None
    try:
        async for out in engine.outputs(stream, delta=True):
            c = out.outputs[0]
            if c.finish_reason == "error":
                raise GenerationError(GENERATION_ERROR)
            cached = out.num_cached_tokens
            output_tokens += len(c.token_ids)
            finish_reason = c.finish_reason
            thought, text = ("", c.text) if reasoning is None else reasoning.feed(c, skip_special)
            content, deltas = (text, []) if calls is None else calls.feed(text, bool(finish_reason))
            for e in events.thought(thought) if thought else []:
                yield e
            for e in events.text(content) if content else []:
                yield e
            for d in deltas:
                for e in events.call(d):
                    yield e
        if all(isinstance(item, OutputReasoning) for item in events.items):
            for e in events.text(""):
                yield e
        for e in events.close(item_status(finish_reason)):
            yield e
        input_tokens = len(stream.state.prompt_token_ids)
        tokens = (input_tokens, output_tokens, cached, reasoning.tokens if reasoning else 0)
        response = finished(base, events.items, finish_reason, *tokens)
        keep(response)
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        yield events.lifecycle(kind, response)
    except Exception as e:  # noqa: BLE001 - reported in the stream, headers are gone
        yield _error_event(events, base.id, e)


def _error_event(events: ResponseEvents, rid: str, e: Exception) -> str:
    """Log an error raised once the headers are sent, then the `error` event the client sees."""
    known = isinstance(e, (EngineDeadError, GenerationError))
    logger.error("response %s: error in the stream: %r", rid, e, exc_info=None if known else e)
    message = str(e) if known else f"internal error ({type(e).__name__})"
    code = "engine_dead" if isinstance(e, EngineDeadError) else "server_error"
    return events.event("error", code=code, message=message, param=None)
