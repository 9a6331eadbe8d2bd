"""Reasoning output on /v1/chat/completions (`pagoda serve --reasoning-parser qwen3 |
deepseek_r1`, vLLM's): each choice's `message.reasoning_content` and `reasoning` (the same text,
vLLM's older and newer names) apart from its `content`, streamed as `delta.reasoning_content` and
`delta.reasoning`, and `usage.completion_tokens_details.reasoning_tokens`
(client/reasoning.py splits the text). A grammar (structured outputs, tool_choice) is enforced
only after the reasoning: the request's grammar carries the token ids of `</think>`
(engine/grammar.py waits for them), unless the prompt has already ended the reasoning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pagoda.client.reasoning import (
    END,
    Phase,
    ReasoningStream,
    opening_phase,
    reasoning_tokens,
    split_reasoning,
)
from pagoda.outputs import CompletionOutput
from pagoda.sampling_params import SamplingParams


class Reasoning:
    """How one chat request's outputs are split: the parser's opening phase after its prompt,
    and the tokenizer that counts reasoning tokens."""

    def __init__(self, parser: str, prompt: str, tokenizer: Any, include: bool = True) -> None:
        """`include`: whether the reasoning is returned (vLLM's include_reasoning); it is split
        from the content either way."""
        self.phase: Phase = opening_phase(parser, prompt)
        self.tokenizer = tokenizer
        self.include = include
        self.end_ids: list[int] = list(tokenizer.encode(END, add_special_tokens=False))
        self._streams: dict[int, tuple[ReasoningStream, list[int]]] = {}
        self.tokens = 0  # reasoning tokens of the samples split so far

    def grammar_after_reasoning(self, params: SamplingParams) -> SamplingParams:
        """`params` with its grammar (if any) enforced only after `</think>` (vLLM's behaviour),
        unless the prompt has already ended the reasoning."""
        grammar = params.structured_outputs
        if grammar is None or self.phase == "answer":
            return params
        gated = dataclasses.replace(grammar, reasoning_end=tuple(self.end_ids))
        return dataclasses.replace(params, structured_outputs=gated)

    def split(self, c: CompletionOutput, skip_special: bool) -> tuple[str | None, str | None]:
        """A whole sample's (reasoning, content); counts its reasoning tokens."""
        reasoning, content, stream = split_reasoning(self.phase, c.text)
        self.tokens += self._count(stream, c.token_ids, skip_special)
        return (reasoning if self.include else None), content

    def feed(self, c: CompletionOutput, skip_special: bool) -> tuple[str, str]:
        """(reasoning, content) of a streamed sample's new output (`c` is its delta)."""
        stream, ids = self._streams.setdefault(c.index, (ReasoningStream(self.phase), []))
        ids.extend(c.token_ids)
        final = c.finish_reason is not None
        reasoning, content = stream.feed(c.text, final)
        if final:
            self.tokens += self._count(stream, ids, skip_special)
        return (reasoning if self.include else ""), content

    def _count(self, stream: ReasoningStream, ids: Sequence[int], skip_special: bool) -> int:
        end_id = self.end_ids[0] if len(self.end_ids) == 1 else None

        def decode(prefix: Sequence[int]) -> str:
            return str(self.tokenizer.decode(list(prefix), skip_special_tokens=skip_special))

        return reasoning_tokens(stream, ids, end_id, decode)
