"""Tools on /v1/chat/completions: what `tools`, `tool_choice` and `parallel_tool_calls` ask for,
as vLLM answers them.

- `auto` (the default when tools are given) needs `--enable-auto-tool-choice` and
  `--tool-call-parser hermes`: the model may call tools, and `<tool_call>` blocks in its output
  become `message.tool_calls` (finish_reason "tool_calls").
- `required` and a named function are enforced by a grammar: the output is one or more Hermes
  calls (one with `parallel_tool_calls: false`, exactly the named one for a named function),
  each call's arguments valid under the function's `parameters` schema. A named call finishes
  with "stop", as OpenAI's does.
- `none`: the tools are still shown to the model (vLLM's default), nothing is parsed.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

from pagoda.client.tool_calls import CLOSE, OPEN, ToolCall, ToolCallDelta, ToolCallStream
from pagoda.server.errors import APIError
from pagoda.server.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from pagoda.structured_outputs import StructuredOutputsParams

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# Calls written as Python's json.dumps writes them (and Qwen2.5 was trained on), no free
# whitespace: a sampled model cannot pad a call forever.
CALL_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request does with tools: the tools its prompt shows, whether its output is
    parsed for calls, and the grammar that enforces them (required or named)."""

    tools: list[dict[str, Any]] | None = None
    mode: Mode = "none"
    grammar: StructuredOutputsParams | None = None

    @property
    def parse(self) -> bool:
        return self.tools is not None and self.mode != "none"

    def finish_reason(self, reason: str | None, calls: int) -> str | None:
        """A sample's finish_reason: "tool_calls" where it called tools and stopped on its own
        (a named call stops with "stop")."""
        if calls and reason == "stop" and self.mode != "named":
            return "tool_calls"
        return reason


def tool_plan(
    body: ChatCompletionRequest,
    auto_tool_choice: bool,
    parser: str | None,
    added_tokens: Collection[str] = (),
) -> ToolPlan:
    """The request's ToolPlan; APIError 400 naming the field for what vLLM refuses.
    `added_tokens`: the tokenizer's added tokens (`get_added_vocab`), which the grammar accepts
    where their text is expected."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise APIError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
        return ToolPlan()
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"tools: function names must be unique, got {names}", "tools")
    if choice is None or choice == "auto":
        if not (auto_tool_choice and parser):
            raise APIError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                "tool_choice",
            )
        return ToolPlan(tools, "auto")
    if choice == "none":
        return ToolPlan(tools, "none")
    if body.structured_outputs is not None or (body.response_format or {}).get("type") not in (
        None,
        "text",
    ):
        raise APIError(
            400,
            "tool_choice 'required' or a named function cannot be combined with response_format "
            "or structured_outputs",
            "tool_choice",
        )
    functions = [t["function"] for t in tools]
    if choice == "required":
        grammar = _grammar(functions, body.parallel_tool_calls, added_tokens)
        return ToolPlan(tools, "required", grammar)
    chosen = [f for f in functions if f["name"] == choice.function.name]
    if not chosen:
        raise APIError(
            400,
            f"tool_choice names the function {choice.function.name!r}, which is not in tools "
            f"({names})",
            "tool_choice",
        )
    return ToolPlan(tools, "named", _grammar(chosen, False, added_tokens))


def _grammar(
    functions: list[dict[str, Any]], parallel: bool, added_tokens: Collection[str]
) -> StructuredOutputsParams:
    """A Lark grammar of Hermes calls to `functions` (one, or several on separate lines)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or EMPTY_PARAMETERS,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": CALL_JSON_STYLE}
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    lark = f'{start}\ncall: {_literal(OPEN, added_tokens)} "\\n" %json {json.dumps(schema)} '
    lark += f'"\\n" {_literal(CLOSE, added_tokens)}'
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark))
    if error:
        raise APIError(
            400, f"tools: a function's parameters are not a usable JSON schema: {error}", "tools"
        )
    return StructuredOutputsParams(grammar=lark)


def _literal(text: str, added_tokens: Collection[str]) -> str:
    """The grammar's literal for `text`, or for the tokenizer's added token of that text as well
    (Qwen2.5 writes <tool_call> as its token 151657): llguidance reads an added token as a
    special token, which only `<name>` in a grammar matches, never the quoted text."""
    quoted = json.dumps(text)
    return f"({quoted} | {text})" if text in added_tokens else quoted


def tool_calls_out(calls: list[ToolCall]) -> list[ToolCallOut]:
    return [
        ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
        for c in calls
    ]


def delta_tool_calls(deltas: list[ToolCallDelta]) -> list[DeltaToolCall]:
    return [
        DeltaToolCall(
            index=d.index,
            id=d.id,
            type="function" if d.id is not None else None,
            function=DeltaFunctionCall(name=d.name, arguments=d.arguments),
        )
        for d in deltas
    ]


class StreamedCalls:
    """The tool-call parsers of a streamed request's choices, one per choice index."""

    def __init__(self) -> None:
        self._streams: dict[int, ToolCallStream] = {}

    def feed(self, index: int, text: str, final: bool) -> tuple[str, list[DeltaToolCall], int]:
        """(content, call deltas, calls so far) of choice `index`'s new text."""
        stream = self._streams.setdefault(index, ToolCallStream())
        content, deltas = stream.feed(text, final)
        return content, delta_tool_calls(deltas), len(stream.calls)
