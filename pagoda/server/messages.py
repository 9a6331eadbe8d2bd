"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat machinery.

A Messages request becomes the chat request it means (`chat_request`): `system` the first
message, text blocks the message's text, tool_use blocks an assistant's tool calls, tool_result
blocks tool messages, `tools` functions, `tool_choice` auto / any / tool / none the chat's auto /
required / named / none (tools.py), `stop_sequences` stop strings, `thinking: {"type":
"disabled"}` the chat_template_kwargs `{"enable_thinking": false}`; thinking blocks of earlier
turns are left out (the chat template renders no earlier thinking). It is then rendered, sampled
and parsed for tool calls exactly as /v1/chat/completions does, so a greedy message equals the
greedy chat completion of the same conversation; under --reasoning-parser the thinking is a
thinking block before the answer's blocks (reasoning.py). The stream is messages_stream.py's.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagoda.client.tool_calls import ToolCall, parse_tool_calls
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.server.anthropic_protocol import (
    CountTokensRequest,
    CountTokensResponse,
    InputMessage,
    MessageResponse,
    MessagesRequest,
    MessageUsage,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    blocks_text,
)
from pagoda.server.chat import chat_params, chat_prompt, conversation
from pagoda.server.errors import APIError
from pagoda.server.generation import add_all, collect, until_disconnect
from pagoda.server.messages_stream import message_events, stop_reason, tool_use_id
from pagoda.server.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCallIn
from pagoda.server.reasoning import Reasoning
from pagoda.server.state import ServerState
from pagoda.server.tools import ToolPlan

CHOICES = {"auto": "auto", "any": "required", "none": "none"}


async def create_message(state: ServerState, body: MessagesRequest, request: Request) -> Response:
    state.check_model(body.model)
    chat = chat_request(body)
    plan, text, ids = chat_prompt(state, chat)
    parser = state.config.reasoning_parser
    reasoning = None if parser is None else Reasoning(parser, text, state.engine.tokenizer)
    params = chat_params(chat, body.max_tokens, None, plan, reasoning)
    rid = f"msg_{uuid.uuid4().hex}"
    streams = await add_all(state, rid, [(text, ids)], params, chat)
    model = state.served_name(body.model)
    if body.stream:
        events = message_events(state, rid, model, plan.parse, streams[0], reasoning)
        return StreamingResponse(events, media_type="text/event-stream")

    async def work() -> Response:
        out = (await collect(state.engine, streams))[0]
        return JSONResponse(_message(model, plan, reasoning, rid, out).model_dump())

    return await until_disconnect(request, work)


async def count_tokens(state: ServerState, body: CountTokensRequest) -> CountTokensResponse:
    """The prompt's length as /v1/messages renders it (the tools shown as they would be)."""
    state.check_model(body.model)
    chat = chat_request(body)
    tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
    _, ids = state.engine.chat_prompt(
        conversation(chat.messages), None, True, False, tools, chat.chat_template_kwargs
    )
    return CountTokensResponse(input_tokens=len(ids))


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages request means; APIError 400 naming the field for what the
    chat request cannot say."""
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body)}
    if body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in body.tools
        ]
    if body.thinking is not None and body.thinking.type == "disabled":
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
        fields["parallel_tool_calls"] = not body.tool_choice.disable_parallel_tool_use
    if isinstance(body, MessagesRequest):
        fields.update(
            max_tokens=body.max_tokens,
            stop=body.stop_sequences,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stream=body.stream,
        )
    return ChatCompletionRequest.model_validate(fields)


def _tool_choice(choice: ToolChoice) -> Any:
    if choice.type != "tool":
        return CHOICES[choice.type]
    if not choice.name:
        raise APIError(400, 'tool_choice.name: required with "type": "tool"', "tool_choice.name")
    return {"type": "function", "function": {"name": choice.name}}


def chat_messages(body: CountTokensRequest) -> list[ChatMessage]:
    """The conversation as chat messages: the system prompt first, each tool_result block a tool
    message (before the rest of its user turn), tool_use blocks the assistant's tool calls."""
    out: list[ChatMessage] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else blocks_text(body.system)
        out.append(ChatMessage(role="system", content=system))
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append(ChatMessage(role=m.role, content=m.content))
            continue
        _check_blocks(i, m)
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                out.append(ChatMessage(role="tool", content=b.text(), tool_call_id=b.tool_use_id))
        texts = [b.text for b in m.content if isinstance(b, TextBlock)]
        calls = [
            ToolCallIn(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
            for b in m.content
            if isinstance(b, ToolUseBlock)
        ]
        if texts or calls or not any(isinstance(b, ToolResultBlock) for b in m.content):
            out.append(ChatMessage(role=m.role, content="".join(texts), tool_calls=calls or None))
    return out


def _check_blocks(i: int, m: InputMessage) -> None:
    wrong = (
        (ToolResultBlock,)
        if m.role == "assistant"
        else (ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)
    )
    for j, b in enumerate(m.content):
        if isinstance(b, wrong):
            where = f"messages.{i}.content.{j}"
            raise APIError(400, f"{where}: a {b.type} block cannot be in a {m.role} message", where)


def _message(
    model: str, plan: ToolPlan, reasoning: Reasoning | None, rid: str, out: RequestOutput
) -> MessageResponse:
    """model: the name the response gives (the adapter's, when the request named one)."""
    c: CompletionOutput = out.outputs[0]
    thought, answer = (None, c.text) if reasoning is None else reasoning.split(c, True)
    text, calls = parse_tool_calls(answer or "") if plan.parse else (answer, [])
    content: list[ThinkingBlock | TextBlock | ToolUseBlock] = (
        [ThinkingBlock(thinking=thought)] if thought else []
    )
    content += [TextBlock(text=text)] if text else []
    content += [_tool_use(call) for call in calls]
    reason, sequence = stop_reason(c, len(calls))
    return MessageResponse(
        id=rid,
        model=model,
        content=content,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=MessageUsage(
            input_tokens=len(out.prompt_token_ids),
            output_tokens=len(c.token_ids),
            cache_read_input_tokens=out.num_cached_tokens,
        ),
    )


def _tool_use(call: ToolCall) -> ToolUseBlock:
    """A parsed call as a tool_use block; arguments cut short (max_tokens) are an empty input."""
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = {}
    if not isinstance(arguments, dict):
        arguments = {}
    return ToolUseBlock(id=tool_use_id(call.id), name=call.name, input=arguments)
