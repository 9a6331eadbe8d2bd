"""Client-side text handling: chat templates, conversations and prompt tokenization (tokenizers
come from the checkpoint via pagoda/loading/)."""

from __future__ import annotations

import inspect
from typing import Any

from pagoda.client.tool_calls import (
    hermes_conversation,
    template_conversation,
    template_knows_tools,
)

Conversation = list[dict[str, Any]]
# A /v1/completions prompt: a string, strings, token ids, or lists of token ids.
CompletionPrompt = str | list[str] | list[int] | list[list[int]]
# (text if given as text, token ids) of one prompt.
Prompt = tuple[str | None, list[int]]


class PromptError(ValueError):
    """Invalid prompt input. `field` names the input at fault ("prompt", "messages",
    "chat_template", "chat_template_kwargs", "tokens"), which the server reports as the error's
    `param`."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def apply_chat_template(
    tokenizer: Any,
    conversation: Conversation,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of a conversation under the tokenizer's (or the given) chat template.
    With `tools`, or tool calls and results in the conversation, a template that does not
    render tools itself gets them written out in the Hermes format (client/tool_calls.py).
    `template_kwargs`: extra variables of the render (vLLM's chat_template_kwargs, such as
    Qwen3's enable_thinking); ValueError where one is a name the render itself sets."""
    clash = sorted(set(template_kwargs) & _render_names(tokenizer)) if template_kwargs else []
    if clash:
        raise ValueError(
            f"chat_template_kwargs must not set {clash}: the render of the chat template sets them"
        )
    if not conversation:
        raise ValueError("messages must not be empty")
    for m in conversation:
        if not isinstance(m, dict) or "role" not in m or not ("content" in m or "tool_calls" in m):
            raise ValueError("each message must be a dict with 'role' and 'content'")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model has no chat template; pass chat_template=...")
    uses_tools = bool(tools) or any(
        m.get("tool_calls") or m["role"] == "tool" for m in conversation
    )
    if uses_tools and not template_knows_tools(template):
        conversation, tools = hermes_conversation(conversation, tools), None
    elif uses_tools:
        conversation = template_conversation(conversation)
    text = tokenizer.apply_chat_template(
        conversation,
        tools=tools,
        chat_template=chat_template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
        **(template_kwargs or {}),
    )
    return str(text)


def _render_names(tokenizer: Any) -> set[str]:
    """The names apply_chat_template sets itself (its own parameters, and the template's
    `messages`): chat_template_kwargs may not override them."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    named = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return named | {"self", "messages"}


def as_conversations(messages: Conversation | list[Conversation]) -> list[Conversation]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of messages or of conversations")
    if all(isinstance(m, list) for m in messages):
        return [list(c) for c in messages]  # type: ignore[arg-type]
    return [messages]  # type: ignore[list-item]


def chat_prompt(
    tokenizer: Any,
    conversation: Conversation,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """A conversation's prompt text and its token ids (the template already holds the special
    tokens). PromptError on field "messages" for a conversation the template refuses, on
    "chat_template" for a template that fails, on "chat_template_kwargs" for a name the render
    sets itself."""
    try:
        text = apply_chat_template(
            tokenizer,
            conversation,
            chat_template,
            add_generation_prompt,
            continue_final_message,
            tools,
            template_kwargs,
        )
    except ValueError as e:
        field = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
        raise PromptError(str(e), field) from e
    except Exception as e:  # a broken template given by the client
        raise PromptError(f"the chat template failed: {e}", "chat_template") from e
    return text, tokenizer.encode(text, add_special_tokens=False)


def completion_prompts(
    tokenizer: Any, prompt: CompletionPrompt, field: str = "prompt"
) -> list[Prompt]:
    """The prompts of a completion request: one per string or token-id list, one for a flat
    list of token ids. PromptError on `field` (/v1/embeddings: "input") if one is empty or of
    another type."""
    items: list[Any] = [prompt] if isinstance(prompt, str) else list(prompt)
    if not items:
        raise PromptError(f"{field} must not be empty", field)
    if all(isinstance(p, int) for p in items):
        return [(None, items)]
    out: list[Prompt] = []
    for p in items:
        if isinstance(p, str):
            if not p:
                raise PromptError(f"{field} must not be empty", field)
            out.append((p, tokenizer.encode(p)))
        elif isinstance(p, list) and all(isinstance(t, int) for t in p):
            out.append((None, list(p)))
        else:
            raise PromptError(f"{field} must be a string, a list of strings or of token ids", field)
    return out
