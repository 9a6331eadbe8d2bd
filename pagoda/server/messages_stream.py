"""A streamed /v1/messages answer: Anthropic's server-sent events, in Anthropic's order.

    message_start, then per content block: content_block_start (a ping after the first),
    content_block_delta... (thinking_delta, text_delta or input_json_delta), content_block_stop
    (a thinking block's after a signature_delta, as Anthropic's, with an empty signature);
    then message_delta (stop_reason, stop_sequence, usage.output_tokens) and message_stop.

Each event is `event: <type>\\n` + `data: <json>\\n\\n`. Text and tool calls are read out of the
output as chat's stream reads them (client/tool_calls.py); a call opens a tool_use block as soon
as its name is read, its arguments stream as input_json_delta. An error once the headers are
sent is one `error` event in Anthropic's shape, the stream's last. Under --reasoning-parser the
thinking (reasoning.py splits it off) is a thinking block, the first.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Literal

from pydantic import BaseModel

from pagoda.client.async_client import EngineDeadError, RequestStream
from pagoda.client.tool_calls import ToolCallDelta, ToolCallStream
from pagoda.outputs import CompletionOutput
from pagoda.server.anthropic_errors import anthropic_error_body
from pagoda.server.anthropic_protocol import (
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    DeltaUsage,
    InputJsonDelta,
    MessageDelta,
    MessageDeltaEvent,
    MessageResponse,
    MessageStartEvent,
    MessageStopEvent,
    MessageUsage,
    PingEvent,
    SignatureDelta,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
)
from pagoda.server.generation import GENERATION_ERROR, GenerationError
from pagoda.server.reasoning import Reasoning
from pagoda.server.state import ServerState

logger = logging.getLogger("pagoda.server")

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def stop_reason(c: CompletionOutput, calls: int) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) of a finished sample that made `calls` tool calls."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    """Anthropic's `toolu_...` id for a parsed call's `call_...` id."""
    return "toolu_" + call_id.removeprefix("call_")


def sse(payload: BaseModel) -> str:
    kind = getattr(payload, "type", "error")
    return f"event: {kind}\ndata: {payload.model_dump_json()}\n\n"


class _Blocks:
    """The content blocks sent so far: the open one's index and kind."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        events = [] if self.open == "text" else self._start(TextBlock(text=""))
        delta = ContentBlockDeltaEvent(index=self.index, delta=TextDelta(text=text))
        return [*events, sse(delta)]

    def thinking(self, text: str) -> list[str]:
        if not text:
            return []
        events = [] if self.open == "thinking" else self._start(ThinkingBlock(thinking=""))
        delta = ContentBlockDeltaEvent(index=self.index, delta=ThinkingDelta(thinking=text))
        return [*events, sse(delta)]

    def call(self, d: ToolCallDelta) -> list[str]:
        events = []
        if d.id is not None:
            block = ToolUseBlock(id=tool_use_id(d.id), name=d.name or "", input={})
            events = self._start(block)
        if d.arguments:
            delta = InputJsonDelta(partial_json=d.arguments)
            events.append(sse(ContentBlockDeltaEvent(index=self.index, delta=delta)))
        return events

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            delta = ContentBlockDeltaEvent(index=self.index, delta=SignatureDelta())
            events.append(sse(delta))
        self.open = None
        return [*events, sse(ContentBlockStopEvent(index=self.index))]

    def _start(self, block: ThinkingBlock | TextBlock | ToolUseBlock) -> list[str]:
        events = self.stop()
        self.index += 1
        self.open = block.type
        events.append(sse(ContentBlockStartEvent(index=self.index, content_block=block)))
        if self.index == 0:
            events.append(sse(PingEvent()))
        return events


async def message_events(
    state: ServerState,
    rid: str,
    model: str,
    parse: bool,
    stream: RequestStream,
    reasoning: Reasoning | None = None,
) -> AsyncIterator[str]:
    """The events of one sample's stream; `model`: the name its message gives (the adapter's,
    when the request named one); `parse`: read tool calls out of its text; `reasoning`: split
    its thinking off."""
    usage = MessageUsage(input_tokens=len(stream.state.prompt_token_ids), output_tokens=0)
    start = MessageResponse(id=rid, model=model, content=[], usage=usage)
    yield sse(MessageStartEvent(message=start))
    blocks = _Blocks()
    calls = ToolCallStream() if parse else None
    output_tokens = 0
    try:
        async for out in state.engine.outputs(stream, delta=True):
            c = out.outputs[0]
            if c.finish_reason == "error":
                raise GenerationError(GENERATION_ERROR)
            output_tokens += len(c.token_ids)
            final = c.finish_reason is not None
            thought, text = ("", c.text) if reasoning is None else reasoning.feed(c, True)
            events = blocks.thinking(thought)
            if calls is None:
                events += blocks.text(text)
            else:
                content, deltas = calls.feed(text, final)
                events += blocks.text(content)
                for d in deltas:
                    events += blocks.call(d)
            for event in events:
                yield event
            if final:
                reason, sequence = stop_reason(c, len(calls.calls) if calls else 0)
                for event in blocks.stop():
                    yield event
                delta = MessageDelta(stop_reason=reason, stop_sequence=sequence)
                yield sse(
                    MessageDeltaEvent(delta=delta, usage=DeltaUsage(output_tokens=output_tokens))
                )
                yield sse(MessageStopEvent())
    except Exception as e:  # noqa: BLE001 - reported in the stream, headers are gone
        yield _stream_error(rid, e)


def _stream_error(rid: str, e: Exception) -> str:
    known = isinstance(e, (EngineDeadError, GenerationError))
    logger.error("request %s: error in the stream: %r", rid, e, exc_info=None if known else e)
    if isinstance(e, EngineDeadError):
        return sse(anthropic_error_body(503, str(e)))
    if isinstance(e, GenerationError):
        return sse(anthropic_error_body(500, str(e)))
    return sse(anthropic_error_body(500, f"internal error ({type(e).__name__})"))
