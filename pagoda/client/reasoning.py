"""Reasoning output: a thinking model's `<think>...</think>` kept apart from its answer, as vLLM's
`--reasoning-parser qwen3` and `deepseek_r1` split it, whole or streamed.

Where the output starts (`opening_phase`, from the prompt's text):
- deepseek_r1: in the reasoning (its template opens `<think>` in the prompt), until `</think>`;
  an output without `</think>` is all reasoning.
- qwen3: the prompt's last think tag decides. `</think>` (Qwen3 with `enable_thinking: false`,
  whose template writes an empty think block) starts in the answer; `<think>` starts in the
  reasoning; no tag starts undecided: the text before the output's first tag is reasoning if
  that tag is `</think>`, answer if it is `<think>` or there is none (Qwen3 without thinking).

In the reasoning, `</think>` ends it and a `<think>` is dropped (neither tag is in either
text); once in the answer, every character is answer. `ReasoningStream` gives the same split
piece by piece: it holds back a tail that may be the start of a tag (a piece ending in `</th`),
and while undecided, all text until a tag or the end decides it.

`reasoning_tokens` counts the output tokens up to and including the one that completes
`</think>` (all of them where the output ended in the reasoning, none where it had none), as
`usage.completion_tokens_details.reasoning_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START = "<think>"
END = "</think>"

Phase = Literal["undecided", "reasoning", "answer"]


def check_reasoning_parser(name: str | None) -> None:
    """ValueError unless `name` is None or one of REASONING_PARSERS."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(
            f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}"
        )


def opening_phase(parser: str, prompt: str) -> Phase:
    """The phase an output starts in, after `prompt` (the rendered chat prompt)."""
    check_reasoning_parser(parser)
    if parser == "deepseek_r1":
        return "reasoning"
    start, end = prompt.rfind(START), prompt.rfind(END)
    if start == end == -1:
        return "undecided"
    return "reasoning" if start > end else "answer"


def _held_tail(text: str) -> int:
    """How many characters at the end of `text` may begin a tag (held back until the next
    piece shows whether they do)."""
    for n in range(min(len(text), len(END) - 1), 0, -1):
        tail = text[-n:]
        if START.startswith(tail) or END.startswith(tail):
            return n
    return 0


class ReasoningStream:
    """One sample's output split into reasoning and answer, piece by piece."""

    def __init__(self, phase: Phase) -> None:
        self.phase: Phase = phase
        self.reasoned = phase == "reasoning"  # whether any of the output is reasoning
        self.ended = False  # whether `</think>` ended the reasoning
        self._held = ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) of a new piece of the output; `final`: it is the last piece."""
        buf = self._held + text
        self._held = ""
        reasoning: list[str] = []
        answer: list[str] = []
        while buf:
            if self.phase == "answer":
                answer.append(buf)
                break
            tag, at = _first_tag(buf)
            if tag is None:
                keep = 0 if final else _held_tail(buf)
                if self.phase == "undecided" and not final:
                    self._held = buf  # reasoning or answer: the next tag or the end decides
                    break
                if keep:
                    self._held = buf[-keep:]
                    buf = buf[:-keep]
                (reasoning if self.phase == "reasoning" else answer).append(buf)
                break
            before, buf = buf[:at], buf[at + len(tag) :]
            if self.phase == "undecided":
                (reasoning if tag == END else answer).append(before)
                self.reasoned = True
            else:
                reasoning.append(before)
            if tag == END:
                self.phase, self.ended = "answer", True
            else:
                self.phase = "reasoning"
        return "".join(reasoning), "".join(answer)


def _first_tag(text: str) -> tuple[str | None, int]:
    """The first whole tag in `text` and where it starts (None, -1 when there is none)."""
    found = [(at, tag) for tag in (START, END) if (at := text.find(tag)) != -1]
    if not found:
        return None, -1
    at, tag = min(found)
    return tag, at


def split_reasoning(phase: Phase, text: str) -> tuple[str | None, str | None, ReasoningStream]:
    """A whole output's (reasoning, answer), each None where empty and the reasoning also where
    the output had none; and the stream that read it (for reasoning_tokens)."""
    stream = ReasoningStream(phase)
    reasoning, answer = stream.feed(text, final=True)
    return (reasoning if stream.reasoned else None), (answer or None), stream


def reasoning_tokens(
    stream: ReasoningStream,
    token_ids: Sequence[int],
    end_token_id: int | None,
    decode: Callable[[Sequence[int]], str],
) -> int:
    """How many of `token_ids` (the output `stream` read) are reasoning. Where `</think>` is one
    token of the vocabulary (`end_token_id`) and the output holds it, the count is by id;
    otherwise by decoding: the shortest prefix whose text holds `</think>` (a binary search)."""
    if not stream.ended:
        return len(token_ids) if stream.phase == "reasoning" else 0
    if end_token_id is not None and end_token_id in token_ids:
        return list(token_ids).index(end_token_id) + 1
    low, high = 1, len(token_ids)
    while low < high:
        mid = (low + high) // 2
        if END in decode(token_ids[:mid]):
            high = mid
        else:
            low = mid + 1
    return low
