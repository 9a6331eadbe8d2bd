"""The run-to-run comparison (tests/equivalence.py) catches what the determinism rule forbids and
lets through only rounding."""

from __future__ import annotations

from typing import Any

import pytest

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from tests.equivalence import (
    LOGPROB_ATOL,
    assert_logprobs_close,
    assert_same_outputs,
    assert_same_up_to_a_near_tie,
)


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


# ---- assert_same_up_to_a_near_tie: the oracle's rules against a reference run -----------------


def _run_of(tokens: list[int], ties: dict[int, dict[int, float]], finish: str = "length") -> Any:
    """A greedy run: each step lists its token at -0.1 and a runner-up at -3.0, or the given
    {token: logprob} at the steps in `ties`."""
    steps = [ties.get(i, {t: -0.1, t + 1000: -3.0}) for i, t in enumerate(tokens)]
    ranked = [
        {t: (lp, r) for r, (t, lp) in enumerate(sorted(d.items(), key=lambda x: -x[1]), 1)}
        for d in steps
    ]
    return _out(tokens, ranked, finish)


TOKENS = list(range(100, 124))  # 24 greedy tokens
TIE_AT_10 = {10: {110: -0.70, 555: -0.72}}  # the reference's top two, 0.02 apart


def _diverging(step: int, token: int = 555) -> list[int]:
    return TOKENS[:step] + [token] + [7] * (len(TOKENS) - step - 1)


def test_equal_runs_pass_and_a_tie_within_the_gap_is_accepted() -> None:
    want = [_run_of(TOKENS, TIE_AT_10)] * 5
    assert assert_same_up_to_a_near_tie(want, want, 0.05) == [None] * 5
    got = [_run_of(_diverging(10), {})] + want[1:]
    assert assert_same_up_to_a_near_tie(got, want, 0.05) == [10, None, None, None, None]


def test_a_divergence_wider_than_the_gap_or_unlisted_fails() -> None:
    want = [_run_of(TOKENS, TIE_AT_10)] * 5
    with pytest.raises(AssertionError, match="gap 0.0200 >= 0.01"):
        assert_same_up_to_a_near_tie([_run_of(_diverging(10), {})] + want[1:], want, 0.01)
    with pytest.raises(AssertionError, match="not among the reference's"):
        assert_same_up_to_a_near_tie([_run_of(_diverging(10, 999), {})] + want[1:], want, 1.0)


def test_a_tie_before_the_eighth_token_fails() -> None:
    want = [_run_of(TOKENS, {3: {103: -0.70, 555: -0.72}})] * 5
    with pytest.raises(AssertionError, match="after only 3 equal tokens"):
        assert_same_up_to_a_near_tie([_run_of(_diverging(3), {})] + want[1:], want, 0.05)


def test_at_most_one_prompt_in_five_may_end_at_a_tie() -> None:
    want = [_run_of(TOKENS, TIE_AT_10)] * 5
    two_ties = [_run_of(_diverging(10), {})] * 2 + want[2:]
    with pytest.raises(AssertionError, match="2 of 5 prompts ended at a near tie"):
        assert_same_up_to_a_near_tie(two_ties, want, 0.05)


def test_lengths_and_finish_reasons_are_always_compared() -> None:
    want = [_run_of(TOKENS, TIE_AT_10)] * 5
    short = [_run_of(_diverging(10)[:20], {})] + want[1:]  # after an accepted tie
    with pytest.raises(AssertionError, match="20 tokens, the reference 24"):
        assert_same_up_to_a_near_tie(short, want, 0.05)
    stopped = [_run_of(TOKENS, TIE_AT_10, finish="stop")] + want[1:]
    with pytest.raises(AssertionError, match="finish reason 'stop'"):
        assert_same_up_to_a_near_tie(stopped, want, 0.05)


def test_logprobs_of_equal_steps_within_the_given_tolerance() -> None:
    want = [_run_of(TOKENS, {})] * 5
    moved = [_run_of(TOKENS, {4: {104: -0.16, 1104: -3.0}})] + want[1:]
    assert_same_up_to_a_near_tie(moved, want, 0.05, logprob_atol=0.1)
    with pytest.raises(AssertionError, match="step 4: log-prob of 104 differs by 0.0600"):
        assert_same_up_to_a_near_tie(moved, want, 0.05, logprob_atol=0.05)
