"""Client-side prompts (pagoda/client/tokenizer.py): what the server's 400s are made of."""

from __future__ import annotations

from typing import Any

import pytest

from pagoda.client.tokenizer import PromptError, chat_prompt, completion_prompts


class FakeTokenizer:
    chat_template = "{{ messages }}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([0] if add_special_tokens else []) + [ord(ch) for ch in text]

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> str:
        if kwargs["chat_template"] == "broken":
            raise RuntimeError("boom")
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation)


def test_completion_prompts() -> None:
    tok = FakeTokenizer()
    assert completion_prompts(tok, "ab") == [("ab", [0, 97, 98])]
    assert completion_prompts(tok, ["a", "b"]) == [("a", [0, 97]), ("b", [0, 98])]
    assert completion_prompts(tok, [5, 6]) == [(None, [5, 6])]
    assert completion_prompts(tok, [[5], [6, 7]]) == [(None, [5]), (None, [6, 7])]


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "prompt must not be empty"),
        ([], "prompt must not be empty"),
        (["a", ""], "prompt must not be empty"),
        ([1, "a"], "prompt must be a string, a list of strings or of token ids"),
    ],
)
def test_completion_prompts_refused(prompt: Any, message: str) -> None:
    with pytest.raises(PromptError, match=message) as e:
        completion_prompts(FakeTokenizer(), prompt)
    assert e.value.field == "prompt"


def test_chat_prompt() -> None:
    text, ids = chat_prompt(FakeTokenizer(), [{"role": "user", "content": "hi"}])
    assert text == "<user>hi"
    assert ids == [ord(ch) for ch in text]  # no special tokens added to a templated prompt


def test_chat_prompt_refused() -> None:
    with pytest.raises(PromptError, match="messages must not be empty") as e:
        chat_prompt(FakeTokenizer(), [])
    assert e.value.field == "messages"
    with pytest.raises(PromptError, match="the chat template failed: boom") as e:
        chat_prompt(FakeTokenizer(), [{"role": "user", "content": "hi"}], "broken")
    assert e.value.field == "chat_template"
