"""/v1/chat/completions: a conversation under the model's (or the request's) chat template, n
samples, whole or streamed."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagoda.client.async_client import AsyncEngine, RequestStream
from pagoda.client.tokenizer import Conversation
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.server.errors import APIError, bad_field
from pagoda.server.generation import (
    add_all,
    collect,
    kv_transfer_response,
    ranked,
    token_text,
    until_disconnect,
    usage,
)
from pagoda.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaMessage,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from pagoda.server.sse import sse_stream
from pagoda.server.state import ServerState


def conversation(messages: list[ChatMessage]) -> Conversation:
    return [{"role": m.role, "content": m.text()} for m in messages]


async def create_chat_completion(
    state: ServerState, body: ChatCompletionRequest, request: Request
) -> Response:
    state.check_model(body.model)
    if body.tools:
        raise APIError(400, "tools are not supported by this server", "tools")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    text, ids = state.engine.chat_prompt(
        conversation(body.messages),
        body.chat_template,
        body.add_generation_prompt,
        body.continue_final_message,
    )
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    try:
        params = body.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise bad_field(e) from e
    rid = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    streams = await add_all(state, rid, [(text, ids)], params, body)
    if body.stream:
        return StreamingResponse(_stream(state, body, rid, streams), media_type="text/event-stream")

    async def work() -> Response:
        out = (await collect(state.engine, streams))[0]
        return JSONResponse(_response(state, body, rid, out).model_dump())

    return await until_disconnect(request, work)


def _response(
    state: ServerState, body: ChatCompletionRequest, rid: str, out: RequestOutput
) -> ChatCompletionResponse:
    choices = [
        ChatChoice(
            index=c.index,
            message=ResponseMessage(content=c.text),
            logprobs=_logprobs(state.engine, c, body.top_logprobs or 0),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in out.outputs
    ]
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    prompt_tokens = len(out.prompt_token_ids)
    return ChatCompletionResponse(
        id=rid,
        model=state.model_name,
        choices=choices,
        usage=usage(prompt_tokens, completion_tokens, out.num_cached_tokens),
        kv_transfer_params=kv_transfer_response(state, body),
    )


def _logprobs(engine: AsyncEngine, c: CompletionOutput, top: int) -> ChatLogprobs | None:
    if c.logprobs is None:
        return None
    content = []
    for tid, entry in zip(c.token_ids, c.logprobs):
        lp = entry[tid]
        text = token_text(engine, tid, lp)
        alts = [
            TopLogprob(
                token=(t := token_text(engine, a, alt)), logprob=alt.logprob, bytes=list(t.encode())
            )
            for a, alt in ranked(entry, top)
        ]
        content.append(
            TokenLogprob(
                token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=alts
            )
        )
    return ChatLogprobs(content=content)


def _stream(
    state: ServerState, body: ChatCompletionRequest, rid: str, streams: list[RequestStream]
) -> AsyncIterator[str]:
    model = state.model_name
    top = body.top_logprobs or 0

    def choice(i: int, index: int, c: CompletionOutput) -> ChatChunkChoice:
        return ChatChunkChoice(
            index=index,
            delta=DeltaMessage(content=c.text),
            logprobs=_logprobs(state.engine, c, top),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def chunk(choices: list[ChatChunkChoice], totals: Usage | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, model=model, choices=choices, usage=totals)

    n = streams[0].state.params.n
    role = DeltaMessage(role="assistant", content="")
    first = chunk([ChatChunkChoice(index=j, delta=role) for j in range(n)], None)
    return sse_stream(state.engine, rid, streams, choice, chunk, body.include_usage, first)
