"""/v1/responses (OpenAI's Responses API): create, retrieve and delete a response.

A request is served as the chat request it amounts to (ResponsesRequest.chat_request): its
input items, after the conversation of `previous_response_id` and under its `instructions`,
become chat messages under the model's chat template (with `chat_template_kwargs`, vLLM's extra
field); `tools` and `tool_choice` take chat's tool machinery (tools.py), `text.format` chat's
response_format grammar. So a greedy response equals the greedy chat completion of the same
conversation. Output: under --reasoning-parser a reasoning item with the thinking (reasoning.py
splits it; grammars apply after it, as on chat), a message item with the text, then one
function_call item per tool call. Stored responses live in a ResponseStore.
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI, Request, params
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagoda.client.tokenizer import PromptError
from pagoda.client.tool_calls import parse_tool_calls
from pagoda.server.chat import chat_params, chat_prompt
from pagoda.server.errors import APIError
from pagoda.server.generation import add_all, collect, until_disconnect
from pagoda.server.protocol import ChatCompletionRequest, ChatMessage
from pagoda.server.reasoning import Reasoning
from pagoda.server.response_events import stream_events
from pagoda.server.response_output import as_message, finished, output_items
from pagoda.server.response_store import ResponseStore, StoredResponse
from pagoda.server.responses_protocol import (
    DeletedResponse,
    FunctionChoice,
    ResponseObject,
    ResponsesRequest,
    TextConfig,
)
from pagoda.server.state import ServerState
from pagoda.server.tools import ToolPlan

# chat's field names in errors -> the Responses field that carries them
_FIELD_NAMES = {
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
    "prompt": "input",
    "tokens": "input",
}


def add_response_routes(
    app: FastAPI, state: ServerState, deps: list[params.Depends], store: ResponseStore
) -> None:
    @app.post("/v1/responses", dependencies=deps)
    async def create(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(state, store, body, request)

    @app.get("/v1/responses/{response_id}", dependencies=deps)
    async def retrieve(response_id: str) -> ResponseObject:
        return _stored(store, response_id, "response_id").response

    @app.delete("/v1/responses/{response_id}", dependencies=deps)
    async def delete(response_id: str) -> DeletedResponse:
        _stored(store, response_id, "response_id")
        store.delete(response_id)
        return DeletedResponse(id=response_id)


def _stored(store: ResponseStore, rid: str, param: str) -> StoredResponse:
    found = store.get(rid)
    if found is None:
        raise APIError(
            404,
            f"Response with id {rid!r} not found (responses are kept in memory, the last "
            f"{store.max_count}, unless created with store: false)",
            param,
        )
    return found


def _renamed(e: APIError) -> APIError:
    param = _FIELD_NAMES.get(e.param or "", e.param)
    return APIError(e.status, e.message, param, e.headers)


async def create_response(
    state: ServerState, store: ResponseStore, body: ResponsesRequest, request: Request
) -> Response:
    try:
        return await _create(state, store, body, request)
    except APIError as e:
        raise _renamed(e) from e
    except PromptError as e:  # the chat template's
        raise _renamed(APIError(400, str(e), e.field)) from e


async def _create(
    state: ServerState, store: ResponseStore, body: ResponsesRequest, request: Request
) -> Response:
    state.check_model(body.model)
    if body.n != 1:
        raise APIError(400, "n: a response has one output (n must be 1)", "n")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise APIError(400, "max_output_tokens must be >= 1", "max_output_tokens")
    history: list[ChatMessage] = []
    if body.previous_response_id is not None:
        history = list(_stored(store, body.previous_response_id, "previous_response_id").messages)
    messages = [*history, *body.input_messages()]
    if not messages:
        raise APIError(400, "input must not be empty", "input")
    chat = body.chat_request(messages)
    plan, reasoning, text, ids = _prompt(state, chat)
    sampling = chat_params(chat, body.max_output_tokens, None, plan, reasoning)
    rid = body.request_id or f"resp_{uuid.uuid4().hex}"
    base = _base(state, body, rid)
    streams = await add_all(state, rid, [(text, ids)], sampling, body)

    def keep(response: ResponseObject) -> None:
        if body.store:
            store.put(StoredResponse(response, [*messages, as_message(response.output)]))

    skip = chat.skip_special_tokens
    if body.stream:
        events = stream_events(state.engine, streams[0], plan.parse, base, keep, reasoning, skip)
        return StreamingResponse(events, media_type="text/event-stream")

    async def work() -> Response:
        out = (await collect(state.engine, streams))[0]
        c = out.outputs[0]
        thought, answer = (None, c.text) if reasoning is None else reasoning.split(c, skip)
        content, calls = parse_tool_calls(answer or "") if plan.parse else (answer, [])
        items = output_items(content or "", calls, c.finish_reason, thought)
        tokens = (len(out.prompt_token_ids), len(c.token_ids), out.num_cached_tokens)
        response = finished(
            base, items, c.finish_reason, *tokens, reasoning.tokens if reasoning else 0
        )
        keep(response)
        return JSONResponse(response.model_dump())

    return await until_disconnect(request, work)


def _prompt(
    state: ServerState, chat: ChatCompletionRequest
) -> tuple[ToolPlan, Reasoning | None, str, list[int]]:
    """The request's tool plan, its reasoning split (under --reasoning-parser) and its prompt."""
    plan, text, ids = chat_prompt(state, chat)
    parser = state.config.reasoning_parser
    reasoning = None if parser is None else Reasoning(parser, text, state.engine.tokenizer)
    return plan, reasoning, text, ids


def _base(state: ServerState, body: ResponsesRequest, rid: str) -> ResponseObject:
    """The response before its output: the request's settings, status in_progress."""
    choice: str | FunctionChoice = body.tool_choice or ("auto" if body.tools else "none")
    return ResponseObject(
        id=rid,
        status="in_progress",
        model=state.served_name(body.model),
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        previous_response_id=body.previous_response_id,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=body.tools or [],
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        text=body.text or TextConfig(),
        store=body.store,
        metadata=body.metadata or {},
    )
