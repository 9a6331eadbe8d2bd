"""Client-side text handling: chat templates and conversations (tokenizers come from the
checkpoint via pagoda/loading/)."""

from __future__ import annotations

from typing import Any

Conversation = list[dict[str, Any]]


def apply_chat_template(
    tokenizer: Any,
    conversation: Conversation,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt text of a conversation under the tokenizer's (or the given) chat template."""
    if not conversation:
        raise ValueError("messages must not be empty")
    for m in conversation:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError("each message must be a dict with 'role' and 'content'")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; pass chat_template=...")
    text = tokenizer.apply_chat_template(
        conversation,
        chat_template=chat_template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
    )
    return str(text)


def as_conversations(messages: Conversation | list[Conversation]) -> list[Conversation]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of messages or of conversations")
    if all(isinstance(m, list) for m in messages):
        return [list(c) for c in messages]  # type: ignore[arg-type]
    return [messages]  # type: ignore[list-item]
