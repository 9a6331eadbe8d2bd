"""A response's output, whole or streamed alike: its items (under --reasoning-parser a reasoning
item with the thinking, where there is some; a message with the answer; then one function_call
item per tool call), the finished response object with its usage, and the assistant message that
continues its conversation (without the thinking, which the chat template does not render)."""

from __future__ import annotations

import uuid

from pagoda.client.tool_calls import ToolCall
from pagoda.server.protocol import ChatMessage, FunctionCall, ToolCallIn
from pagoda.server.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseObject,
    ResponseUsage,
    Status,
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def item_status(finish_reason: str | None) -> Status:
    """The status of the item the output ends in (an item closed before the end is complete)."""
    return "incomplete" if finish_reason == "length" else "completed"


def message_item(text: str, status: Status) -> OutputMessage:
    return OutputMessage(id=new_id("msg"), status=status, content=[OutputText(text=text)])


def reasoning_item(text: str, status: Status) -> OutputReasoning:
    return OutputReasoning(id=new_id("rs"), status=status, content=[ReasoningText(text=text)])


def call_item(call_id: str, name: str, arguments: str, status: Status) -> OutputFunctionCall:
    return OutputFunctionCall(
        id=new_id("fc"), call_id=call_id, name=name, arguments=arguments, status=status
    )


def output_items(
    content: str, calls: list[ToolCall], finish_reason: str | None, thought: str | None = None
) -> list[OutputItem]:
    """A whole output's items: a reasoning item with `thought` (where it is not empty), a
    message with the text (unless there is none beside calls), then its calls; the last one has
    the output's status."""
    items: list[OutputItem] = [reasoning_item(thought, "completed")] if thought else []
    if content or not calls:
        items.append(message_item(content, "completed"))
    items += [call_item(c.id, c.name, c.arguments, "completed") for c in calls]
    items[-1].status = item_status(finish_reason)
    return items


def finished(
    base: ResponseObject,
    items: list[OutputItem],
    finish_reason: str | None,
    input_tokens: int,
    output_tokens: int,
    cached_tokens: int,
    reasoning_tokens: int = 0,
) -> ResponseObject:
    """`base` (the request's response, in progress) with its output and usage; incomplete
    where max_output_tokens (or the model's length) cut it."""
    incomplete = finish_reason == "length"
    usage = ResponseUsage(
        input_tokens=input_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
        output_tokens=output_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
        total_tokens=input_tokens + output_tokens,
    )
    details = IncompleteDetails(reason="max_output_tokens") if incomplete else None
    return base.model_copy(
        update={
            "status": "incomplete" if incomplete else "completed",
            "output": items,
            "incomplete_details": details,
            "usage": usage,
        }
    )


def as_message(items: list[OutputItem]) -> ChatMessage:
    """A response's output as the assistant message that continues its conversation."""
    text = "".join(p.text for i in items if isinstance(i, OutputMessage) for p in i.content)
    calls = [
        ToolCallIn(id=i.call_id, function=FunctionCall(name=i.name, arguments=i.arguments))
        for i in items
        if isinstance(i, OutputFunctionCall)
    ]
    return ChatMessage(role="assistant", content=text, tool_calls=calls or None)
