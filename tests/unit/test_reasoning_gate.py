"""A grammar that waits for the end of the reasoning (engine/grammar.py, ReasoningGate), without
a model: the masks of a step (plain and verifying drafts), a draft model's masks, and the
matcher advanced only past the end. The SmolLM2 tokenizer, where `</think>` is several tokens."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from pagoda.engine.grammar import GrammarCompiler, ReasoningGate, StructuredOutputs
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.messages import ScheduledRequest
from pagoda.scheduling.request import Request
from pagoda.structured_outputs import StructuredOutputsParams

VOCAB = 49152


def _allowed(row: bytes) -> list[int]:
    words = np.frombuffer(row, dtype=np.int32)
    return [t for t in range(VOCAB) if words[t // 32] >> (t % 32) & 1]


def test_the_gate_closes_on_the_whole_end_only() -> None:
    gate = ReasoningGate((7, 8))
    assert gate.free_positions([]) == 1
    assert gate.free_positions([7, 8, 9]) == 2
    assert gate.free_positions([8, 7, 9]) == 4  # not among them: every position is free
    assert not gate.feed(7)
    assert gate.free_positions([8]) == 1  # the end straddles the last step and this one
    assert not gate.feed(9) and not gate.feed(7) and gate.feed(8)


def test_masks_and_matcher_start_after_the_end(smollm2_tokenizer: Any) -> None:
    end = tuple(smollm2_tokenizer.encode("</think>", add_special_tokens=False))
    assert len(end) > 1
    think = smollm2_tokenizer.encode("Hmm", add_special_tokens=False)[0]
    yes = smollm2_tokenizer.encode("yes", add_special_tokens=False)
    grammar = StructuredOutputsParams(choice=["yes", "no"], reasoning_end=end)
    compiler = GrammarCompiler(lambda: smollm2_tokenizer, VOCAB, [2])
    structured = StructuredOutputs(compiler, VOCAB)
    request = Request("r", [1, 5], SamplingParams(structured_outputs=grammar), 20, frozenset([2]))
    structured.add(request)
    ready, failed = structured.take_ready(wait_s=60)
    assert ready == [request] and not failed
    start = _allowed(compiler.compile(grammar).result().deep_copy().compute_bitmask())
    assert think not in start and yes[0] in start

    def step(tokens: list[int], drafts: int) -> ScheduledRequest:
        return ScheduledRequest("r", tokens, 2, 0, sample_ids=["r"], num_draft_tokens=drafts)

    assert structured.bitmasks([step([think], 0)]) == {}  # thinking: no mask
    drafts = [think, *end]  # the end completes at the last draft: the position after is masked
    rows = structured.bitmasks([step([5, *drafts], len(drafts))])["r"]
    assert len(rows) == len(drafts) + 1
    assert [_allowed(r) == list(range(VOCAB)) for r in rows] == [True] * len(drafts) + [False]
    assert _allowed(rows[-1]) == start
    # a draft model's masks: free until the end is among the tokens, then the grammar's
    assert structured.draft_mask("r", [think, *end[:-1]]) is None
    assert _allowed(structured.draft_mask("r", [think, *end]) or b"") == start
    after_y = structured.draft_mask("r", [think, *end, yes[0]])
    assert after_y is not None and _allowed(after_y) != start

    def accept(tokens: list[int]) -> tuple[dict[str, int], dict[str, int]]:
        out = SimpleNamespace(request_id="r", new_token_ids=tokens, finish_reason=None)
        return structured.accept([out])

    assert accept([think, end[0]]) == ({}, {})  # the grammar refuses `think`: it is not asked
    request.output_token_ids.extend([think, end[0]])  # as the scheduler's update does
    assert "r" in structured.gates
    assert structured.draft_mask("r", [think, *end]) is not None  # the end straddles steps
    ended, broken = accept([*end[1:], *yes])
    assert ended == {"r": len(end) - 1 + len(yes)} and broken == {}
    assert "r" not in structured.gates
    compiler.shutdown()
