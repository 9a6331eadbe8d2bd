"""Tool calls in the Hermes format: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
as Qwen2.5's chat template writes them (and NousResearch's Hermes models before it).

- `hermes_conversation` renders tools, assistant tool calls and tool results into plain messages
  for a chat template that knows nothing of tools (SmolLM2's): the tool list goes into the
  system message, calls into the assistant's text, results into a user turn.
- `template_conversation` is what a tool-aware template gets instead: the messages as given,
  with each call's `arguments` JSON text turned into an object (as vLLM does).
- `ToolCallStream` reads tool calls out of a model's output, as a whole or piece by piece; both
  give the same calls and the same content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

# The opening of a call whose arguments are an object, name first: the call's name streams as
# soon as this is read, its arguments as they come.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


def template_knows_tools(template: Any) -> bool:
    """Whether a chat template renders `tools` itself (a template that is not text is assumed
    to)."""
    return not isinstance(template, str) or "tools" in template


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The system-prompt text that describes the tools and the call format."""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_PREAMBLE + lines + TOOLS_INSTRUCTIONS


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def _arguments(value: Any) -> Any:
    """A call's arguments as an object: OpenAI sends them as JSON text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call)
        out.append((str(function.get("name", "")), _arguments(function.get("arguments", {}))))
    return out


def template_conversation(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a tool-aware template: arguments as objects, not JSON text."""
    out = []
    for m in conversation:
        if m.get("tool_calls"):
            m = dict(m)
            m["tool_calls"] = [
                {**c, "function": {"name": n, "arguments": a}}
                for c, (n, a) in zip(m["tool_calls"], _calls(m))
            ]
        out.append(m)
    return out


def hermes_conversation(
    conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation in plain messages of text, tools and calls written out in the Hermes
    format. Consecutive tool results join one user turn, each in <tool_response> tags."""
    out: list[dict[str, Any]] = []
    for m in conversation:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(n, a) for n, a in _calls(m))
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        block = tools_block(tools)
        if out and out[0]["role"] == "system":
            system = out[0]["content"]
            out[0]["content"] = f"{system}\n\n{block}" if system else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


@dataclass
class ToolCallDelta:
    """What a step of the stream adds to call `index`: its id and name the first time, then
    pieces of its arguments (JSON text)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class _Block:
    """The call being read: the text after <tool_call>, up to </tool_call>."""

    start: int
    id: str | None = None  # set once its header is read: the call is announced
    args_start: int = 0
    scanned: int = 0  # how far the arguments are scanned (absolute position)
    sent: int = 0  # how far they are sent (absolute position)
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    args_end: int | None = None


@dataclass
class ToolCallStream:
    """Tool calls and content out of a model's output, fed in pieces.

    A block `<tool_call>...</tool_call>` (or `<tool_call>...` to the end of the output) is a call
    when its text opens `{"name": "<name>", "arguments": {` (the call is announced there and its
    arguments stream as they come, up to the object's closing brace), or, read whole, is a JSON
    object with a string "name" and an "arguments" (or "parameters") value. Any other block is
    content, tags included. Content is the text outside the calls, without the whitespace next to
    a call; whitespace that may precede a call is held back until what follows shows it does not.
    """

    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    _pos: int = 0
    _block: _Block | None = None
    _after_call: bool = False
    _held: str = ""

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(content, call deltas) that `piece` adds; `final` on the last piece flushes all."""
        self.text += piece
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._block is None:
                i = self.text.find(OPEN, self._pos)
                if i < 0:
                    end = len(self.text) if final else len(self.text) - _partial(self.text, OPEN)
                    content.append(self._content(self.text[self._pos : max(end, self._pos)]))
                    self._pos = max(end, self._pos)
                    if final:
                        content.append(self._held)
                        self._held = ""
                    break
                content.append(self._content(self.text[self._pos : i], before_call=True))
                self._pos = i + len(OPEN)
                self._block = _Block(start=self._pos)
                continue
            j = self.text.find(CLOSE, self._block.start)
            if j < 0 and not final:
                deltas.extend(self._stream_block(len(self.text) - _partial(self.text, CLOSE)))
                break
            end = j if j >= 0 else len(self.text)
            extra, delta = self._close_block(end, closed=j >= 0)
            content.append(extra)
            deltas.extend(delta)
            self._pos = end + len(CLOSE) if j >= 0 else end
        return "".join(content), deltas

    def _content(self, text: str, before_call: bool = False) -> str:
        if self._after_call:
            text = text.lstrip()
            if not text and not before_call:
                return ""
            self._after_call = False
        if before_call:
            self._held = ""
            return text.rstrip()
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        out = self._held + body
        self._held = text[len(body) :]
        return out

    def _stream_block(self, upto: int) -> list[ToolCallDelta]:
        """Announce the block's call once its header is read, then send its arguments so far."""
        block = self._block
        assert block is not None
        out = []
        if block.id is None:
            header = _HEADER.match(self.text, block.start, upto)
            if header is None:
                return []
            block.id = _new_id()
            block.args_start = block.scanned = block.sent = header.end()
            name = _json_string(header.group(1))
            self.calls.append(ToolCall(block.id, name, ""))
            out.append(ToolCallDelta(len(self.calls) - 1, id=block.id, name=name))
        _scan(self.text, block, upto)
        stop = block.args_end if block.args_end is not None else block.scanned
        if stop > block.sent:
            piece = self.text[block.sent : stop]
            block.sent = stop
            self.calls[-1].arguments += piece
            if out:
                out[0].arguments = piece
            else:
                out.append(ToolCallDelta(len(self.calls) - 1, arguments=piece))
        return out

    def _close_block(self, end: int, closed: bool) -> tuple[str, list[ToolCallDelta]]:
        """The block ends at `end` (with its closing tag if `closed`): its last deltas, or its
        text as content if it is no call."""
        block = self._block
        assert block is not None
        deltas = self._stream_block(end)
        self._block = None
        if block.id is None:
            whole = _whole_call(self.text[block.start : end])
            if whole is None:
                raw = OPEN + self.text[block.start : end] + (CLOSE if closed else "")
                return self._content(raw), []
            name, arguments = whole
            self.calls.append(ToolCall(_new_id(), name, arguments))
            deltas = [ToolCallDelta(len(self.calls) - 1, arguments, self.calls[-1].id, name)]
        self._after_call = True
        return "", deltas


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content or None, calls) of a whole output."""
    stream = ToolCallStream()
    content, _ = stream.feed(text, final=True)
    return content or None, stream.calls


def _scan(text: str, block: _Block, upto: int) -> None:
    """Advance the scan of the arguments object to `upto`, stopping at its closing brace."""
    i = block.scanned
    while i < upto and block.args_end is None:
        c = text[i]
        if block.in_string:
            if block.escape:
                block.escape = False
            elif c == "\\":
                block.escape = True
            elif c == '"':
                block.in_string = False
        elif c == '"':
            block.in_string = True
        elif c in "{[":
            block.depth += 1
        elif c in "}]":
            block.depth -= 1
            if block.depth == 0:
                block.args_end = i + 1
        i += 1
    block.scanned = i


def _whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a block read whole, or None if it is no call."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if arguments is None:
        return None
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that could begin `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _json_string(escaped: str) -> str:
    try:
        return str(json.loads(f'"{escaped}"'))
    except json.JSONDecodeError:
        return escaped


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
