"""The reasoning parsers (client/reasoning.py): whole outputs, the same outputs streamed in every
split, the opening phase from the prompt, and the reasoning token count. No model."""

from __future__ import annotations

import pytest

from pagoda.client.reasoning import (
    ReasoningStream,
    check_reasoning_parser,
    opening_phase,
    reasoning_tokens,
    split_reasoning,
)

QWEN3_THINKING_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINKING_PROMPT = QWEN3_THINKING_PROMPT + "<think>\n\n</think>\n\n"
OPENED_PROMPT = QWEN3_THINKING_PROMPT + "<think>\n"


def test_opening_phase() -> None:
    assert opening_phase("qwen3", QWEN3_THINKING_PROMPT) == "undecided"
    assert opening_phase("qwen3", QWEN3_NO_THINKING_PROMPT) == "answer"
    assert opening_phase("qwen3", OPENED_PROMPT) == "reasoning"
    # an earlier turn's closed block, then an opened one: the last tag counts
    assert opening_phase("qwen3", "<think>a</think>b" + OPENED_PROMPT) == "reasoning"
    for prompt in (QWEN3_THINKING_PROMPT, QWEN3_NO_THINKING_PROMPT, OPENED_PROMPT):
        assert opening_phase("deepseek_r1", prompt) == "reasoning"


def test_bad_parser_name() -> None:
    check_reasoning_parser(None)
    check_reasoning_parser("qwen3")
    with pytest.raises(ValueError, match="--reasoning-parser must be one of qwen3, deepseek_r1"):
        check_reasoning_parser("qwen")
    with pytest.raises(ValueError, match="got 'r1'"):
        opening_phase("r1", "")


# (opening phase, output, reasoning, content): vLLM's semantics
CASES = [
    # qwen3, no tag in the prompt
    ("undecided", "<think>\nabc\n</think>\n\nthe answer", "\nabc\n", "\n\nthe answer"),
    ("undecided", "no tags at all", None, "no tags at all"),
    ("undecided", "before</think>after", "before", "after"),
    ("undecided", "<think>unfinished", "unfinished", None),
    ("undecided", "<think></think>", "", None),
    ("undecided", "x<think>y</think>z", "y", "xz"),
    ("undecided", "", None, None),
    # qwen3 with thinking off (the prompt closed the block): all answer, tags as text
    ("answer", "a</think>b<think>c", None, "a</think>b<think>c"),
    # the prompt opened the block (qwen3's thinking templates, deepseek_r1)
    ("reasoning", "abc</think>def", "abc", "def"),
    ("reasoning", "never closed", "never closed", None),
    ("reasoning", "<think>abc</think>def</think>g", "abc", "def</think>g"),
    ("reasoning", "</think>", "", None),
    ("reasoning", "a<th", "a<th", None),
    ("reasoning", "a</thinking>b", "a</thinking>b", None),
]


@pytest.mark.parametrize(("phase", "text", "reasoning", "content"), CASES)
def test_whole(phase: str, text: str, reasoning: str | None, content: str | None) -> None:
    got_reasoning, got_content, _ = split_reasoning(phase, text)  # type: ignore[arg-type]
    assert (got_reasoning, got_content) == (reasoning, content)


def _streamed(phase: str, pieces: list[str]) -> tuple[list[tuple[str, str]], ReasoningStream]:
    stream = ReasoningStream(phase)  # type: ignore[arg-type]
    outs = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return outs, stream


@pytest.mark.parametrize(("phase", "text", "reasoning", "content"), CASES)
def test_streamed_in_two_pieces_at_every_split(
    phase: str, text: str, reasoning: str | None, content: str | None
) -> None:
    for cut in range(len(text) + 1):
        outs, stream = _streamed(phase, [text[:cut], text[cut:]])
        assert "".join(r for r, _ in outs) == (reasoning or "")
        assert "".join(c for _, c in outs) == (content or "")
        assert stream.reasoned == (reasoning is not None)


@pytest.mark.parametrize(("phase", "text", "reasoning", "content"), CASES)
def test_streamed_a_character_at_a_time(
    phase: str, text: str, reasoning: str | None, content: str | None
) -> None:
    outs, _ = _streamed(phase, [*text, ""])
    assert "".join(r for r, _ in outs) == (reasoning or "")
    assert "".join(c for _, c in outs) == (content or "")


def test_a_partial_tag_is_held_back() -> None:
    stream = ReasoningStream("reasoning")
    assert stream.feed("thinking</th", final=False) == ("thinking", "")
    assert stream.feed("ink>ans", final=False) == ("", "ans")
    assert stream.feed("wer", final=True) == ("", "wer")
    stream = ReasoningStream("reasoning")
    assert stream.feed("a</th", final=False) == ("a", "")
    assert stream.feed("en", final=False) == ("</then", "")  # not a tag after all
    # nothing is held back in the answer
    stream = ReasoningStream("answer")
    assert stream.feed("x</th", final=False) == ("", "x</th")


def test_undecided_text_waits_for_a_tag_or_the_end() -> None:
    stream = ReasoningStream("undecided")
    assert stream.feed("abc", final=False) == ("", "")
    assert stream.feed("</think>d", final=False) == ("abc", "d")
    stream = ReasoningStream("undecided")
    assert stream.feed("abc", final=False) == ("", "")
    assert stream.feed("", final=True) == ("", "abc")
    stream = ReasoningStream("undecided")
    assert stream.feed("<think>a", final=False) == ("a", "")


def _count(phase: str, pieces: list[str], end_id: int | None) -> int:
    """reasoning_tokens of an output whose tokens' texts are `pieces` (token i's id is i, or
    `end_id` where its text is the whole tag)."""
    ids = [end_id if p == "</think>" and end_id is not None else i for i, p in enumerate(pieces)]
    _, _, stream = split_reasoning(phase, "".join(pieces))  # type: ignore[arg-type]

    def decode(prefix: object) -> str:
        return "".join(pieces[: len(prefix)])  # type: ignore[arg-type]

    return reasoning_tokens(stream, ids, end_id, decode)


def test_reasoning_tokens() -> None:
    output = ["<think>", "a", "b", "</think>", "\n", "c"]
    # by id: up to and including </think>
    assert _count("undecided", output, end_id=99) == 4
    # without an id (the tag is several tokens): the shortest prefix that holds it
    split = ["<think>", "a", "b", "</", "think", ">", "\n", "c"]
    assert _count("undecided", split, end_id=None) == 6
    # the tag is one token of the vocabulary, yet the model spelled it in pieces
    assert _count("undecided", split, end_id=99) == 6
    assert _count("reasoning", ["a", "b"], end_id=99) == 2  # never closed: all reasoning
    assert _count("undecided", ["a", "b"], end_id=99) == 0  # Qwen3 without thinking
    assert _count("answer", ["a", "</think>", "b"], end_id=99) == 0
