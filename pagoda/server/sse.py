"""The one server-sent-events loop behind streaming /v1/completions and /v1/chat/completions.

A stream is `data: <json>\\n\\n` events ending with `data: [DONE]\\n\\n`. The endpoints differ only
in how a sample's new output becomes a choice (`choice`), how choices become an event's payload
(`chunk`), and chat's opening event (`first`). An error once the headers are sent reaches the
client as one event in OpenAI's error shape, before [DONE].
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from pydantic import BaseModel

from pagoda.client.async_client import AsyncEngine, EngineDeadError, RequestStream
from pagoda.outputs import CompletionOutput
from pagoda.server.errors import error_body
from pagoda.server.generation import GENERATION_ERROR, GenerationError, merge, usage
from pagoda.server.protocol import Usage

logger = logging.getLogger("pagoda.server")

Choice = TypeVar("Choice")
# (prompt index, choice index, a sample's new output) -> the endpoint's choice, or None where
# there is nothing to send yet (text held back by a tool-call parser)
MakeChoice = Callable[[int, int, CompletionOutput], Choice | None]
# (choices, usage or None) -> an event's payload; the usage event has no choices
MakeChunk = Callable[[list[Choice], Usage | None], BaseModel]

DONE = "data: [DONE]\n\n"


async def sse_stream(
    engine: AsyncEngine,
    rid: str,
    streams: list[RequestStream],
    choice: MakeChoice[Choice],
    chunk: MakeChunk[Choice],
    include_usage: bool,
    first: BaseModel | None = None,
) -> AsyncIterator[str]:
    """The events of a request's streams (one per prompt, each with n samples). Choice i * n + j
    is sample j of prompt i; after its finish_reason nothing more is sent for it."""
    if first is not None:
        yield sse_event(first)
    n = streams[0].state.params.n
    completion_tokens = 0
    cached = [0] * len(streams)
    done: set[int] = set()
    try:
        async for i, out in merge([engine.outputs(s, delta=True) for s in streams]):
            cached[i] = out.num_cached_tokens
            choices = []
            for c in out.outputs:
                index = i * n + c.index
                if index in done or not (c.text or c.token_ids or c.finish_reason):
                    continue
                if c.finish_reason == "error":
                    raise GenerationError(GENERATION_ERROR)
                if c.finish_reason is not None:
                    done.add(index)
                completion_tokens += len(c.token_ids)
                made = choice(i, index, c)
                if made is not None:
                    choices.append(made)
            if choices:
                yield sse_event(chunk(choices, None))
        if include_usage:
            prompt_tokens = sum(len(s.state.prompt_token_ids) for s in streams)
            yield sse_event(chunk([], usage(prompt_tokens, completion_tokens, sum(cached))))
    except Exception as e:  # noqa: BLE001 - reported in the stream, headers are gone
        yield _stream_error(rid, e)
    yield DONE


def sse_event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def _stream_error(rid: str, e: Exception) -> str:
    """Log an error raised once a stream's headers are sent (the client only sees it as an SSE
    event), then the event. A dead engine is logged without a traceback: its cause is logged
    where the engine died."""
    traceback = None if isinstance(e, (EngineDeadError, GenerationError)) else e
    logger.error("request %s: error in the stream: %r", rid, e, exc_info=traceback)
    if isinstance(e, EngineDeadError):
        return sse_event(error_body(503, str(e)))
    if isinstance(e, GenerationError):
        return sse_event(error_body(500, str(e)))
    return sse_event(error_body(500, f"internal error ({type(e).__name__})"))
