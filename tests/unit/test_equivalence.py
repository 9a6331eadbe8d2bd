"""The run-to-run comparison (tests/equivalence.py) catches what the determinism rule forbids and
lets through only rounding."""

from __future__ import annotations

import pytest

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from tests.equivalence import LOGPROB_ATOL, assert_logprobs_close, assert_same_outputs


def _out(
    tokens: list[int],
    step_logprobs: list[dict[int, tuple[float, int]]],
    finish: str = "length",
    prompt: list[dict[int, tuple[float, int]] | None] | None = None,
) -> RequestOutput:
    def entry(d: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        return {t: Logprob(lp, rank) for t, (lp, rank) in d.items()}

    sample = CompletionOutput(
        index=0,
        text="",
        token_ids=tokens,
        cumulative_logprob=sum(step_logprobs[i][t][0] for i, t in enumerate(tokens)),
        logprobs=[entry(d) for d in step_logprobs],
        finish_reason=finish,
    )
    prompt_lps = None if prompt is None else [d and entry(d) for d in prompt]
    return RequestOutput("r", None, [1, 2], prompt_lps, [sample], finished=True)


BASE = [{5: (-0.1, 1), 6: (-2.5, 2)}, {7: (-0.3, 1), 8: (-1.9, 2)}]


def _shifted(delta: float) -> list[dict[int, tuple[float, int]]]:
    return [{t: (lp + delta, r) for t, (lp, r) in d.items()} for d in BASE]


def test_rounding_within_tolerance_passes() -> None:
    assert_same_outputs([_out([5, 7], _shifted(LOGPROB_ATOL / 2))], [_out([5, 7], BASE)])


def test_logprob_beyond_tolerance_fails() -> None:
    with pytest.raises(AssertionError, match="logprob"):
        assert_same_outputs([_out([5, 7], _shifted(3 * LOGPROB_ATOL))], [_out([5, 7], BASE)])


def test_different_tokens_or_finish_fail() -> None:
    other = [BASE[0], {8: (-0.3, 1), 7: (-1.9, 2)}]
    with pytest.raises(AssertionError, match="tokens differ"):
        assert_same_outputs([_out([5, 8], other)], [_out([5, 7], BASE)])
    with pytest.raises(AssertionError):
        assert_same_outputs([_out([5, 7], BASE, finish="stop")], [_out([5, 7], BASE)])


def test_prompt_logprobs_are_compared() -> None:
    want = _out([5, 7], BASE, prompt=[None, {3: (-4.0, 7)}])
    got = _out([5, 7], BASE, prompt=[None, {3: (-4.01, 7)}])
    with pytest.raises(AssertionError, match="prompt position 1"):
        assert_same_outputs([got], [want])


def test_rank_swap_only_at_a_tie() -> None:
    want = {1: Logprob(-1.0, 1), 2: Logprob(-1.00002, 2)}
    assert_logprobs_close({1: Logprob(-1.00003, 2), 2: Logprob(-1.00001, 1)}, want, LOGPROB_ATOL)
    far = {1: Logprob(-1.0, 1), 2: Logprob(-1.5, 2)}
    with pytest.raises(AssertionError, match="rank"):
        assert_logprobs_close({1: Logprob(-1.0, 2), 2: Logprob(-1.5, 1)}, far, LOGPROB_ATOL)


def test_top_k_membership_changes_only_at_the_boundary() -> None:
    want = {1: Logprob(-0.5, 1), 2: Logprob(-2.0, 2)}
    boundary = {1: Logprob(-0.5, 1), 3: Logprob(-2.00001, 2)}
    assert_logprobs_close(boundary, want, LOGPROB_ATOL)
    inside = {1: Logprob(-0.5, 1), 3: Logprob(-1.0, 2)}
    with pytest.raises(AssertionError, match="one run only"):
        assert_logprobs_close(inside, want, LOGPROB_ATOL)
