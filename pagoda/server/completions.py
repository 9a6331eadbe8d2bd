"""/v1/completions: one or more prompts (text or token ids), n samples each, whole or streamed."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagoda.client.async_client import AsyncEngine, RequestStream
from pagoda.client.tokenizer import Prompt
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
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from pagoda.server.sse import MakeChoice, sse_stream
from pagoda.server.state import ServerState


async def create_completion(
    state: ServerState, body: CompletionRequest, request: Request
) -> Response:
    state.check_model(body.model)
    if body.suffix is not None:
        raise APIError(400, "suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of must be unset or equal to n", "best_of")
    prompts = state.engine.completion_prompts(body.prompt)
    try:
        params = body.sampling_params(body.max_tokens, body.logprobs)
    except ValueError as e:
        raise bad_field(e) from e
    rid = body.request_id or f"cmpl-{uuid.uuid4().hex}"
    streams = await add_all(state, rid, prompts, params, body)
    if body.stream:
        return StreamingResponse(
            _stream(state, body, rid, streams, prompts), media_type="text/event-stream"
        )

    async def work() -> Response:
        outs = await collect(state.engine, streams)
        response = _response(state, body, rid, outs, prompts, params.n)
        return JSONResponse(response.model_dump())

    return await until_disconnect(request, work)


def _choice(
    engine: AsyncEngine, c: CompletionOutput, index: int, text: str, top: int, offset: int
) -> CompletionChoice:
    """Choice `index` carrying `text` (the sample's text, maybe after the echoed prompt) whose
    first token starts at `offset` in the choice's whole text."""
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=_logprobs(engine, c, top, offset),
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )


def _logprobs(
    engine: AsyncEngine, c: CompletionOutput, top: int, offset: int
) -> CompletionLogprobs | None:
    if c.logprobs is None:
        return None
    result = CompletionLogprobs()
    for tid, entry in zip(c.token_ids, c.logprobs):
        lp = entry[tid]
        text = token_text(engine, tid, lp)
        result.tokens.append(text)
        result.token_logprobs.append(lp.logprob)
        result.top_logprobs.append(
            {token_text(engine, t, alt): alt.logprob for t, alt in ranked(entry, top)}
            if top
            else None
        )
        result.text_offset.append(offset)
        offset += len(text)
    return result


def _response(
    state: ServerState,
    body: CompletionRequest,
    rid: str,
    outs: list[RequestOutput],
    prompts: list[Prompt],
    n: int,
) -> CompletionResponse:
    choices = []
    completion_tokens = 0
    for i, out in enumerate(outs):
        prefix = (prompts[i][0] or "") if body.echo else ""
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            text = prefix + c.text
            choices.append(
                _choice(state.engine, c, i * n + c.index, text, body.logprobs or 0, len(prefix))
            )
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    cached = sum(o.num_cached_tokens for o in outs)
    return CompletionResponse(
        id=rid,
        model=state.served_name(body.model),
        choices=choices,
        usage=usage(prompt_tokens, completion_tokens, cached),
        kv_transfer_params=kv_transfer_response(state, body),
    )


def _stream(
    state: ServerState,
    body: CompletionRequest,
    rid: str,
    streams: list[RequestStream],
    prompts: list[Prompt],
) -> AsyncIterator[str]:
    def chunk(choices: list[CompletionChoice], totals: Usage | None) -> CompletionResponse:
        return CompletionResponse(
            id=rid, model=state.served_name(body.model), choices=choices, usage=totals
        )

    choice = _stream_choices(state.engine, body, prompts)
    return sse_stream(state.engine, rid, streams, choice, chunk, body.include_usage)


def _stream_choices(
    engine: AsyncEngine, body: CompletionRequest, prompts: list[Prompt]
) -> MakeChoice[CompletionChoice]:
    """The streamed choices: each choice's first one starts with its prompt under `echo`."""
    top = body.logprobs or 0
    offsets: dict[int, int] = {}  # choice index -> length of the text sent so far

    def choice(i: int, index: int, c: CompletionOutput) -> CompletionChoice:
        first = index not in offsets
        offset = offsets.get(index, 0)
        text = (prompts[i][0] or "") + c.text if body.echo and first else c.text
        offsets[index] = offset + len(text)
        return _choice(engine, c, index, text, top, offset)

    return choice
