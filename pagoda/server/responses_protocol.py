"""OpenAI Responses API schemas (/v1/responses): the request with its input items, tools and
text format, and the response object with its output items (pydantic, as protocol.py).

A request takes the Responses fields plus the sampling fields /v1/chat/completions takes
(SamplingFields: seed, top_k, stop, ... through the client's extra_body); `chat_request` states
it as the chat request it is served as.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from pagoda.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    OpenAIModel,
    SamplingFields,
    ToolCallIn,
    ToolDefinition,
)


# ---- input items -------------------------------------------------------------------------------
class InputText(OpenAIModel):
    """A text part of an input message (`output_text` where an earlier answer is sent back)."""

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(OpenAIModel):
    """A call the model made (sent back as conversation state)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(OpenAIModel):
    """The result of call `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningItem(OpenAIModel):
    """A reasoning item of an earlier response sent back; it is left out of the prompt (as vLLM
    leaves it: the chat template renders no earlier thinking)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


_ITEM_TAGS = {
    "message": "MessageItem",
    "function_call": "FunctionCallItem",
    "function_call_output": "FunctionCallOutputItem",
    "reasoning": "ReasoningItem",
}


def _item_kind(value: Any) -> str | None:
    """An input item's class (a message may leave its type out); the tags are class names, which
    an error's `param` leaves out (errors.py)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return _ITEM_TAGS.get(kind) if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("MessageItem")]
    | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]
    | Annotated[ReasoningItem, Tag("ReasoningItem")],
    Discriminator(_item_kind),
]


# ---- tools and text format ---------------------------------------------------------------------
class FunctionTool(OpenAIModel):
    """A function tool, flat as the Responses API has it."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    """`text.format`: plain text, any JSON object, or JSON under `schema`."""

    model_config = ConfigDict(extra="ignore", serialize_by_alias=True, validate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        """The same format as chat's response_format."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec: dict[str, Any] = {"name": self.name or "response"}
        if self.schema_ is not None:
            spec["schema"] = self.schema_
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(OpenAIModel):
    format: TextFormat = Field(default_factory=TextFormat)


# ---- the request -------------------------------------------------------------------------------
class ResponsesRequest(SamplingFields):
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    # vLLM's extra field: variables of the chat template's render, e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def grammar_field(self) -> str:
        return "structured_outputs" if self.structured_outputs is not None else "text.format"

    def input_messages(self) -> list[ChatMessage]:
        """The input items as chat messages: function calls join the assistant message before
        them (or make one), as a response's output continues its conversation
        (response_output.as_message); a call's output is a tool message; reasoning items are
        left out."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        out: list[ChatMessage] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, FunctionCallOutputItem):
                out.append(ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id))
            elif isinstance(item, FunctionCallItem):
                call = ToolCallIn(
                    id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
                )
                last = out[-1] if out else None
                if last is not None and last.role == "assistant":
                    last.tool_calls = [*(last.tool_calls or []), call]
                else:
                    out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        return out

    def chat_request(self, messages: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request this one is served as, over `messages` (instructions first)."""
        if self.instructions is not None:
            messages = [ChatMessage(role="system", content=self.instructions), *messages]
        fields = self.model_dump(include=set(SamplingFields.model_fields))
        if self.text is not None:
            fields["response_format"] = self.text.format.response_format()
        tools = [
            ToolDefinition(
                type="function", function=FunctionDefinition(**t.model_dump(exclude={"type"}))
            )
            for t in self.tools or ()
        ]
        choice: Literal["none", "auto", "required"] | NamedToolChoice | None
        if isinstance(self.tool_choice, FunctionChoice):
            name = NamedFunction(name=self.tool_choice.name)
            choice = NamedToolChoice(type="function", function=name)
        else:
            choice = self.tool_choice
        return ChatCompletionRequest(
            **fields,
            messages=messages,
            max_tokens=self.max_output_tokens,
            tools=tools or None,
            tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls,
            chat_template_kwargs=self.chat_template_kwargs,
        )


# ---- the response ------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


Status = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Status
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Status


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """The thinking of a model served with --reasoning-parser (the output's first item)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Status


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response: its request's settings echoed, its output items and usage."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: str | FunctionChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    truncation: Literal["disabled"] = "disabled"


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
