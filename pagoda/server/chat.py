"""/v1/chat/completions: a conversation under the model's (or the request's) chat template, n
samples, whole or streamed."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagoda.client.async_client import AsyncEngine, RequestStream
from pagoda.client.tokenizer import Conversation
from pagoda.client.tool_calls import parse_tool_calls
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams
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
    CompletionTokensDetails,
    DeltaMessage,
    DeltaToolCall,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from pagoda.server.reasoning import Reasoning
from pagoda.server.sse import sse_stream
from pagoda.server.state import ServerState
from pagoda.server.tools import StreamedCalls, ToolPlan, tool_calls_out, tool_plan


def conversation(messages: list[ChatMessage]) -> Conversation:
    """The messages as the chat template reads them (tool calls and their ids kept)."""
    out: Conversation = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


async def create_chat_completion(
    state: ServerState, body: ChatCompletionRequest, request: Request
) -> Response:
    state.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    plan, text, ids = chat_prompt(state, body)
    parser, tokenizer = state.config.reasoning_parser, state.engine.tokenizer
    reasoning = (
        None if parser is None else Reasoning(parser, text, tokenizer, body.include_reasoning)
    )
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = chat_params(body, max_tokens, logprobs, plan, reasoning)
    rid = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    streams = await add_all(state, rid, [(text, ids)], params, body)
    if body.stream:
        events = _stream(state, body, plan, reasoning, rid, streams)
        return StreamingResponse(events, media_type="text/event-stream")

    async def work() -> Response:
        out = (await collect(state.engine, streams))[0]
        return JSONResponse(_response(state, body, plan, reasoning, rid, out).model_dump())

    return await until_disconnect(request, work)


def chat_prompt(state: ServerState, body: ChatCompletionRequest) -> tuple[ToolPlan, str, list[int]]:
    """A chat request's tool plan and its prompt (text and ids) under the chat template (the
    request's own, else the model's); /v1/responses and /v1/messages serve their chat request."""
    tokenizer = state.engine.tokenizer
    added = tokenizer.get_added_vocab() if body.tools and tokenizer is not None else {}
    config = state.config
    plan = tool_plan(body, config.enable_auto_tool_choice, config.tool_call_parser, added)
    text, ids = state.engine.chat_prompt(
        conversation(body.messages),
        body.chat_template,
        body.add_generation_prompt,
        body.continue_final_message,
        plan.tools,
        body.chat_template_kwargs,
    )
    return plan, text, ids


def chat_params(
    body: ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    plan: ToolPlan,
    reasoning: Reasoning | None,
) -> SamplingParams:
    """A chat request's SamplingParams (400 naming a bad field) with its tool grammar, which
    holds only after the reasoning (/v1/responses and /v1/messages serve their chat request)."""
    try:
        params = body.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise bad_field(e) from e
    if plan.grammar is not None:
        params = dataclasses.replace(params, structured_outputs=plan.grammar)
    return params if reasoning is None else reasoning.grammar_after_reasoning(params)


def _response(
    state: ServerState,
    body: ChatCompletionRequest,
    plan: ToolPlan,
    reasoning: Reasoning | None,
    rid: str,
    out: RequestOutput,
) -> ChatCompletionResponse:
    choices = []
    for c in out.outputs:
        thought, text = (
            (None, c.text) if reasoning is None else reasoning.split(c, body.skip_special_tokens)
        )
        content, calls = parse_tool_calls(text or "") if plan.parse else (text, [])
        message = ResponseMessage(
            content=content,
            tool_calls=tool_calls_out(calls),
            reasoning_content=thought,
            reasoning=thought,
        )
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=_logprobs(state.engine, c, body.top_logprobs or 0),
                finish_reason=plan.finish_reason(c.finish_reason, len(calls)),
                stop_reason=c.stop_reason,
            )
        )
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    prompt_tokens = len(out.prompt_token_ids)
    return ChatCompletionResponse(
        id=rid,
        model=state.served_name(body.model),
        choices=choices,
        usage=_with_reasoning(
            usage(prompt_tokens, completion_tokens, out.num_cached_tokens), reasoning
        ),
        kv_transfer_params=kv_transfer_response(state, body),
    )


def _with_reasoning(totals: Usage, reasoning: Reasoning | None) -> Usage:
    """The usage with its reasoning tokens counted, under a reasoning parser."""
    if reasoning is not None:
        totals.completion_tokens_details = CompletionTokensDetails(
            reasoning_tokens=reasoning.tokens
        )
    return totals


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
    state: ServerState,
    body: ChatCompletionRequest,
    plan: ToolPlan,
    reasoning: Reasoning | None,
    rid: str,
    streams: list[RequestStream],
) -> AsyncIterator[str]:
    model = state.served_name(body.model)
    top = body.top_logprobs or 0
    calls = StreamedCalls()

    def choice(i: int, index: int, c: CompletionOutput) -> ChatChunkChoice | None:
        finish_reason = c.finish_reason
        logprobs = _logprobs(state.engine, c, top)
        if reasoning is None:
            thought, text = "", c.text
            delta = DeltaMessage(content=text)
        else:
            thought, text = reasoning.feed(c, body.skip_special_tokens)
            if not (thought or text or finish_reason or logprobs or plan.parse):
                return None  # text held back until it shows whether a tag begins
            delta = _delta(thought, text or None)
        if plan.parse:
            content, deltas, n_calls = calls.feed(index, text, finish_reason is not None)
            if not (content or deltas or finish_reason or logprobs or thought):
                return None  # text held back until it shows whether a call begins
            delta = _delta(thought, content or None, deltas)
            finish_reason = plan.finish_reason(finish_reason, n_calls)
        return ChatChunkChoice(
            index=index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=c.stop_reason,
        )

    def chunk(choices: list[ChatChunkChoice], totals: Usage | None) -> ChatCompletionChunk:
        if totals is not None:
            totals = _with_reasoning(totals, reasoning)
        return ChatCompletionChunk(id=rid, model=model, choices=choices, usage=totals)

    n = streams[0].state.params.n
    role = DeltaMessage(role="assistant", content="")
    first = chunk([ChatChunkChoice(index=j, delta=role) for j in range(n)], None)
    return sse_stream(state.engine, rid, streams, choice, chunk, body.include_usage, first)


def _delta(
    thought: str, content: str | None, calls: list[DeltaToolCall] | None = None
) -> DeltaMessage:
    """A streamed choice's delta: its reasoning (under both names) where it has some."""
    return DeltaMessage(
        content=content,
        reasoning_content=thought or None,
        reasoning=thought or None,
        tool_calls=calls or [],
    )
