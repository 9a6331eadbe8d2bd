"""The HF oracle's greedy comparison (tests/oracle.py) on synthetic log-probs, no model: each rule
of its module doc fails the case it exists for and accepts a genuine near tie."""

from __future__ import annotations

import pytest
import torch

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from tests.oracle import (
    BF16_TIE_GAP,
    MIN_EQUAL_TOKENS,
    TIE_GAP,
    assert_forced_match,
    assert_greedy_match,
    assert_greedy_matches,
    assert_outputs_match,
    logprob_table,
)

VOCAB = 16
STEPS = 12


def _hf(seed: int, steps: int = STEPS) -> tuple[list[int], torch.Tensor]:
    """(greedy tokens, (steps, VOCAB) log-probs) with every top-2 gap at least 1 nat."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(steps, VOCAB, generator=gen)
    tokens = torch.randint(VOCAB, (steps,), generator=gen)
    logits[torch.arange(steps), tokens] = logits.max(dim=-1).values + 1.0
    return tokens.tolist(), torch.log_softmax(logits, dim=-1)


def _tie(hf: tuple[list[int], torch.Tensor], step: int, gap: float) -> list[int]:
    """Pagoda's tokens: HF's up to `step`, there HF's runner-up, made `gap` below HF's token."""
    tokens, logprobs = hf
    row = logprobs[step].clone()
    row[tokens[step]] = float("-inf")
    other = int(row.argmax())
    logprobs[step, other] = logprobs[step, tokens[step]] - gap
    return tokens[:step] + [other] + [(t + 1) % VOCAB for t in tokens[step + 1 :]]


def test_all_equal_passes_with_no_tie(capsys: pytest.CaptureFixture[str]) -> None:
    expected = [_hf(seed) for seed in range(3)]
    lps = [[float(lp[s, t]) for s, t in enumerate(toks)] for toks, lp in expected]
    ties = assert_greedy_matches(
        [toks for toks, _ in expected], expected, lps, finish_reasons=["length"] * 3
    )
    assert ties == [None, None, None]
    assert "0 of 3 prompts ended at a near tie" in capsys.readouterr().out


def test_wrong_token_far_below_is_caught_even_at_a_top2_tie_and_in_the_top5() -> None:
    """The case the old rule let through: HF's own top-2 gap is below TIE_GAP, pagoda's token is
    HF's 5th, 8 nats below HF's, and pagoda's output is longer."""
    tokens, logprobs = _hf(0)
    step = 9
    order = [t for t in range(VOCAB) if t != tokens[step]]
    top = logprobs[step, tokens[step]]
    logprobs[step, order[0]] = top - 5e-4  # HF's top-2 gap < TIE_GAP
    logprobs[step, order[1]] = top - 1.0
    logprobs[step, order[2]] = top - 2.0
    logprobs[step, order[3]] = top - 8.0  # HF's 5th
    logprobs[step, order[4:]] = top - 20.0
    pagoda = tokens[:step] + [order[3]] + tokens[step + 1 :] + [3]
    with pytest.raises(AssertionError, match=r"differ at step 9: .*rank 5.*gap 8\.000e\+00"):
        assert_greedy_match(pagoda, tokens, logprobs)


def test_wrong_length_is_caught() -> None:
    tokens, logprobs = _hf(1)
    with pytest.raises(AssertionError, match="produced 13 tokens, the oracle 12"):
        assert_greedy_match(tokens + [5], tokens, logprobs)
    with pytest.raises(AssertionError, match="produced 11 tokens, the oracle 12"):
        assert_greedy_match(tokens[:-1], tokens, logprobs)


def test_wrong_length_after_an_accepted_tie_is_caught() -> None:
    hf = _hf(2)
    pagoda = _tie(hf, 9, gap=TIE_GAP / 2)
    assert assert_greedy_match(pagoda, *hf) == 9
    with pytest.raises(AssertionError, match="produced 13 tokens, the oracle 12"):
        assert_greedy_match(pagoda + [1], *hf)


def test_wrong_finish_reason_is_caught() -> None:
    tokens, logprobs = _hf(3)
    assert assert_greedy_match(tokens, tokens, logprobs, finish_reason="length") is None
    with pytest.raises(AssertionError, match="finish reason 'stop', expected 'length'"):
        assert_greedy_match(tokens, tokens, logprobs, finish_reason="stop")
    hf = _hf(4)
    with pytest.raises(AssertionError, match="finish reason 'stop'"):  # also after a tie
        assert_greedy_match(_tie(hf, 10, TIE_GAP / 2), *hf, finish_reason="stop")


def test_genuine_tie_within_the_gap_is_accepted_and_counted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    expected = [_hf(seed) for seed in range(10, 15)]
    pagoda = [toks for toks, _ in expected]
    pagoda[2] = _tie(expected[2], MIN_EQUAL_TOKENS, gap=TIE_GAP / 2)
    assert assert_greedy_matches(pagoda, expected) == [None, None, 8, None, None]
    out = capsys.readouterr().out
    assert "near tie accepted, prompt 2, step 8: pagoda" in out and "gap 5.000e-04" in out
    assert "1 of 5 prompts ended at a near tie" in out


def test_tie_just_outside_the_gap_fails_and_a_wider_gap_is_the_callers() -> None:
    hf = _hf(20)
    pagoda = _tie(hf, 9, gap=2 * TIE_GAP)
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_greedy_match(pagoda, *hf)
    assert assert_greedy_match(pagoda, *hf, tie_gap=BF16_TIE_GAP) == 9


def test_more_than_one_in_five_prompts_at_a_tie_fails() -> None:
    expected = [_hf(seed) for seed in range(30, 40)]
    pagoda = [toks for toks, _ in expected]
    for i in (1, 6):
        pagoda[i] = _tie(expected[i], 9, gap=TIE_GAP / 2)
    assert assert_greedy_matches(pagoda, expected).count(None) == 8  # 2 of 10: allowed
    with pytest.raises(AssertionError, match="2 of 5 prompts ended at a near tie"):
        assert_greedy_matches(pagoda[:4] + pagoda[6:7], expected[:4] + expected[6:7])
    with pytest.raises(AssertionError, match="1 of 1 prompts"):  # fewer than 5: none allowed
        assert_greedy_matches(pagoda[1:2], expected[1:2])


@pytest.mark.parametrize("step", [0, MIN_EQUAL_TOKENS - 1])
def test_tie_before_the_minimum_equal_prefix_fails(step: int) -> None:
    hf = _hf(40)
    with pytest.raises(AssertionError, match=f"after only {step} equal tokens"):
        assert_greedy_match(_tie(hf, step, gap=TIE_GAP / 2), *hf)


def test_logprob_mismatch_beyond_atol_is_caught() -> None:
    tokens, logprobs = _hf(50)
    lps = [float(logprobs[s, t]) for s, t in enumerate(tokens)]
    assert_greedy_match(tokens, tokens, logprobs, [lp + 9e-4 for lp in lps])
    lps[3] += 2e-3
    with pytest.raises(AssertionError, match="log-prob of token .* at step 3"):
        assert_greedy_match(tokens, tokens, logprobs, lps)
    assert_greedy_match(tokens, tokens, logprobs, lps, logprob_atol=3e-3)


def test_logprob_of_pagodas_token_at_the_tie_is_checked() -> None:
    hf = _hf(60)
    pagoda = _tie(hf, 9, gap=TIE_GAP / 2)
    lps = [float(hf[1][s, t]) for s, t in enumerate(pagoda)]
    assert assert_greedy_match(pagoda, *hf, lps) == 9
    lps[9] = float(hf[1][9, hf[0][9]]) - 1e-2  # pagoda's token at HF's log-prob of its own, off
    with pytest.raises(AssertionError, match="at step 9"):
        assert_greedy_match(pagoda, *hf, lps)


def _output(tokens: list[int], finish_reason: str | None) -> RequestOutput:
    completion = CompletionOutput(0, "", tokens, None, None, finish_reason)
    return RequestOutput("0", None, [1], None, [completion], True)


def test_engine_outputs_are_checked_for_tokens_and_finish_reasons() -> None:
    expected = [_hf(seed) for seed in range(70, 72)]
    outs = [_output(toks, "length") for toks, _ in expected]
    assert assert_outputs_match(outs, expected) == [None, None]
    outs[1] = _output(expected[1][0], "stop")
    with pytest.raises(AssertionError, match="prompt 1: finish reason 'stop'"):
        assert_outputs_match(outs, expected)


def test_logprob_table_puts_tokens_outside_the_top_k_out_of_any_gap() -> None:
    table = logprob_table([{3: Logprob(-0.5), 7: Logprob(-0.9)}], VOCAB)
    assert table[0, 3] == -0.5 and table[0, 7] == pytest.approx(-0.9)
    assert torch.isneginf(table[0, 0])
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_greedy_match([0], [3], table, tie_gap=BF16_TIE_GAP)


# ---- rule 6: teacher-forced comparison (assert_forced_match) ------------------------------


def _forced_output(tokens: list[int], logprobs: torch.Tensor, top: int = 5) -> RequestOutput:
    """A fast path's forced run as forced_logprobs gives it: at each step the forced token's
    log-prob and rank, then the top `top` (ranks 1..top) of `logprobs` (steps, VOCAB)."""
    entries = []
    for step, token in enumerate(tokens):
        row = logprobs[step]
        rank = int((row > row[token]).sum()) + 1
        entry = {token: Logprob(float(row[token]), rank)}
        values, ids = row.topk(top)
        for r, (lp, tid) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            entry.setdefault(tid, Logprob(lp, r))
        entries.append(entry)
    completion = CompletionOutput(0, "", tokens, None, entries, "length")
    return RequestOutput("0", None, [1], None, [completion], True)


def _runner_up(row: torch.Tensor, token: int) -> int:
    others = row.clone()
    others[token] = float("-inf")
    return int(others.argmax())


def test_forced_all_equal_passes_with_no_tie(capsys: pytest.CaptureFixture[str]) -> None:
    expected = [_hf(seed) for seed in range(80, 83)]
    outs = [_forced_output(toks, lp.clone()) for toks, lp in expected]
    assert assert_forced_match(outs, expected, tie_gap=BF16_TIE_GAP, logprob_atol=1e-6) == 0
    out = capsys.readouterr().out
    assert (
        "36 steps of 3 prompts: 0 near ties" in out
        and "log-prob of the forced token 0.000e+00" in out
    )


def test_forced_wrong_top1_outside_the_gap_is_caught() -> None:
    tokens, ref = _hf(84)
    fast = ref.clone()
    other = _runner_up(ref[3], tokens[3])  # the reference ranks it >= 1 nat below its top-1
    fast[3, other] = fast[3, tokens[3]] + 0.5
    with pytest.raises(
        AssertionError, match=r"top-1 differs at prompt 0, step 3: .*not a near tie"
    ):
        assert_forced_match(
            [_forced_output(tokens, fast)], [(tokens, ref)], tie_gap=BF16_TIE_GAP, logprob_atol=0.1
        )


def test_forced_top1_outside_the_reference_top_k_is_caught() -> None:
    tokens, ref = _hf(85)
    table = logprob_table(_forced_output(tokens, ref, top=2).outputs[0].logprobs or [], VOCAB)
    fast = ref.clone()
    outside = int(ref[5].argsort()[-4])  # the reference's 4th: -inf in its top-2 table
    fast[5, outside] = ref[5, tokens[5]] + 1.0
    with pytest.raises(AssertionError, match=r"step 5: .*gap inf, not a near tie"):
        assert_forced_match(
            [_forced_output(tokens, fast)],
            [(tokens, table)],
            tie_gap=BF16_TIE_GAP,
            logprob_atol=2.0,
        )


def test_forced_logprob_beyond_atol_is_caught() -> None:
    tokens, ref = _hf(86)
    fast = ref.clone()
    fast[7, tokens[7]] -= 0.09  # still the top-1: every reference gap is >= 1 nat
    assert_forced_match(
        [_forced_output(tokens, fast)], [(tokens, ref)], tie_gap=BF16_TIE_GAP, logprob_atol=0.1
    )
    fast[7, tokens[7]] -= 0.02
    with pytest.raises(
        AssertionError, match=r"log-prob of forced token \d+ at step 7: .* > atol 0.1"
    ):
        assert_forced_match(
            [_forced_output(tokens, fast)], [(tokens, ref)], tie_gap=BF16_TIE_GAP, logprob_atol=0.1
        )


def test_forced_ties_are_counted_at_any_step_in_any_number_of_prompts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Step 0 (rule 3 would refuse it) and in 2 of 2 prompts (rule 5 would): nothing is skipped
    after a forced tie, so neither rule applies."""
    expected = [_hf(seed) for seed in (87, 88)]
    outs = []
    for toks, ref in expected:
        fast = ref.clone()
        for step in (0, 6):
            other = _runner_up(ref[step], toks[step])
            ref[step, other] = ref[step, toks[step]] - 0.125  # one bf16 step below
            fast[step, other] = fast[step, toks[step]] + 0.125
        outs.append(_forced_output(toks, fast))
    assert assert_forced_match(outs, expected, tie_gap=BF16_TIE_GAP, logprob_atol=1e-6) == 4
    out = capsys.readouterr().out
    assert "forced near tie, prompt 0, step 0: fast top-1" in out and "gap 1.250e-01" in out
    assert "24 steps of 2 prompts: 4 near ties" in out
    with pytest.raises(AssertionError, match="not a near tie"):  # the float32 gap is narrower
        assert_forced_match(outs, expected, tie_gap=TIE_GAP, logprob_atol=1e-6)


def test_forced_exactly_equal_top_logprobs_are_one_top1() -> None:
    """Which of two equal log-probs argmax returns is index order: when the fast path's top-1
    ties exactly with the reference's top-1, that is a match, not a tie."""
    tokens, ref = _hf(89)
    step = next(s for s, t in enumerate(tokens) if t > 0)
    fast = ref.clone()
    fast[step, 0] = fast[step, tokens[step]]  # argmax of fast[step] returns 0
    assert int(fast[step].argmax()) == 0
    outs = [_forced_output(tokens, fast)]
    assert assert_forced_match(outs, [(tokens, ref)], tie_gap=TIE_GAP, logprob_atol=1e-6) == 0


def test_forced_run_not_following_the_reference_is_caught() -> None:
    tokens, ref = _hf(90)
    wrong = tokens[:4] + [(tokens[4] + 1) % VOCAB] + tokens[5:]
    with pytest.raises(AssertionError, match="not forced to the reference's tokens"):
        assert_forced_match(
            [_forced_output(wrong, ref)], [(tokens, ref)], tie_gap=BF16_TIE_GAP, logprob_atol=1.0
        )
    short = _forced_output(tokens[:-1], ref)
    with pytest.raises(AssertionError, match="not forced"):
        assert_forced_match([short], [(tokens, ref)], tie_gap=BF16_TIE_GAP, logprob_atol=1.0)
