"""Anthropic Messages request, response, stream-event and error schemas (/v1/messages).

Requests take Anthropic's fields; unknown ones (metadata, cache_control, ...) are ignored.
`max_tokens` and `model` are required, as Anthropic requires them. Content blocks are text,
tool_use, tool_result, thinking and redacted_thinking; any other block type is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- content blocks (in requests and responses) -----------------------------------------------
class TextBlock(AnthropicModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(AnthropicModel):
    """The thinking of a model served with --reasoning-parser (no signature: it is "")."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(AnthropicModel):
    type: Literal["redacted_thinking"]
    data: str = ""


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else blocks_text(self.content)


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


def blocks_text(blocks: list[TextBlock]) -> str:
    return "".join(b.text for b in blocks)


# ---- requests ----------------------------------------------------------------------------------
class InputMessage(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(AnthropicModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(AnthropicModel):
    """auto (the default with tools), any (some tool), tool (the one named), none."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(AnthropicModel):
    """`thinking`: "disabled" renders the chat template with enable_thinking false (Qwen3's);
    "enabled" (and "adaptive") leave the template's default; budget_tokens is not enforced."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(AnthropicModel):
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


# ---- responses ---------------------------------------------------------------------------------
class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


# ---- stream events -----------------------------------------------------------------------------
class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessageResponse


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ThinkingBlock | TextBlock | ToolUseBlock


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDelta(BaseModel):
    type: Literal["signature_delta"] = "signature_delta"
    signature: str = ""


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: str | None
    stop_sequence: str | None = None


class DeltaUsage(BaseModel):
    output_tokens: int


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: DeltaUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


# ---- errors ------------------------------------------------------------------------------------
class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
