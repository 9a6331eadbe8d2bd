"""What two pagoda runs of the same requests must agree on, and nothing more (docs/determinism.md).

Across batch composition, chunk size, prefix caching on / off, async scheduling and preemption on
CPU, pagoda guarantees:
- tokens, finish reasons and stop reasons identical, for greedy and for seeded sampling;
- every log-probability (sampled, top-k and prompt) within `LOGPROB_ATOL` of the other run's.

Logprobs are not bitwise equal: a row's logits are reduced in a different order when the rows
around it change (another GEMM blocking, another attention split), so their last bits move.
Because of that, the set of top-k tokens and their ranks are compared only where they are
decided by more than the tolerance: a token may enter or leave the top-k, or change rank, only
next to a neighbour within `LOGPROB_ATOL` of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from tests.oracle import MIN_EQUAL_TOKENS, assert_tie_budget

# Float32 rounding of a log-softmax over a 49k vocabulary moves the 5th decimal at most (seen:
# 1e-5); 1e-4 keeps a 10x margin and still catches any real change of the distribution.
LOGPROB_ATOL = 1e-4


def assert_same_outputs(
    got: Sequence[RequestOutput], want: Sequence[RequestOutput], atol: float = LOGPROB_ATOL
) -> None:
    assert len(got) == len(want), f"{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        where = f"request {i}"
        assert len(g.outputs) == len(w.outputs), f"{where}: {len(g.outputs)} samples"
        for gs, ws in zip(g.outputs, w.outputs):
            assert_same_sample(gs, ws, atol, f"{where} sample {ws.index}")
        assert (g.prompt_logprobs is None) == (w.prompt_logprobs is None), where
        if g.prompt_logprobs is not None and w.prompt_logprobs is not None:
            assert len(g.prompt_logprobs) == len(w.prompt_logprobs), where
            for pos, (gp, wp) in enumerate(zip(g.prompt_logprobs, w.prompt_logprobs)):
                assert (gp is None) == (wp is None), f"{where} prompt position {pos}"
                if gp is not None and wp is not None:
                    assert_logprobs_close(gp, wp, atol, f"{where} prompt position {pos}")


def assert_same_sample(
    got: CompletionOutput, want: CompletionOutput, atol: float, where: str = "sample"
) -> None:
    assert got.token_ids == want.token_ids, (
        f"{where}: tokens differ\n  got:  {got.token_ids}\n  want: {want.token_ids}"
    )
    assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason), where
    assert (got.logprobs is None) == (want.logprobs is None), where
    if got.logprobs is not None and want.logprobs is not None:
        assert len(got.logprobs) == len(want.logprobs), where
        for step, (g, w) in enumerate(zip(got.logprobs, want.logprobs)):
            assert_logprobs_close(g, w, atol, f"{where} step {step}")
    if want.cumulative_logprob is not None and got.cumulative_logprob is not None:
        # A sum of len(tokens) values, each within atol.
        bound = atol * max(1, len(want.token_ids))
        assert abs(got.cumulative_logprob - want.cumulative_logprob) <= bound, (
            f"{where}: cumulative logprob {got.cumulative_logprob} vs {want.cumulative_logprob}"
        )


def assert_logprobs_close(
    got: dict[int, Logprob], want: dict[int, Logprob], atol: float, where: str = "position"
) -> None:
    """One position's {token: Logprob}: shared tokens within atol; ranks and membership equal
    unless a neighbour within atol makes the order a matter of rounding."""
    for token in got.keys() & want.keys():
        g, w = got[token], want[token]
        assert abs(g.logprob - w.logprob) <= atol, (
            f"{where}: token {token} logprob {g.logprob:.7f} vs {w.logprob:.7f} (atol {atol})"
        )
        if g.rank != w.rank:
            assert _rank_may_differ(g, w, token, got, want, atol), (
                f"{where}: token {token} rank {g.rank} vs {w.rank}, no tie within {atol}"
            )
    for extra, mine, other in (
        (got.keys() - want.keys(), got, want),
        (want.keys() - got.keys(), want, got),
    ):
        for token in extra:
            # Only a swap at the top-k boundary: the token sits within atol of the other run's
            # lowest listed logprob.
            lowest = min(lp.logprob for lp in other.values())
            assert abs(mine[token].logprob - lowest) <= atol, (
                f"{where}: token {token} ({mine[token].logprob:.7f}) listed in one run only; "
                f"the other's lowest is {lowest:.7f}"
            )


def _rank_may_differ(
    g: Logprob,
    w: Logprob,
    token: int,
    got: dict[int, Logprob],
    want: dict[int, Logprob],
    atol: float,
) -> bool:
    if _has_neighbour(w.logprob, want, token, atol) or _has_neighbour(g.logprob, got, token, atol):
        return True
    # A sampled token ranked below the listed top-k can tie with a token nobody listed: by one.
    listed = len(want) - 1
    unlisted = g.rank is not None and w.rank is not None and min(g.rank, w.rank) > listed
    return unlisted and abs((g.rank or 0) - (w.rank or 0)) <= 1


def _has_neighbour(value: float, entries: dict[int, Logprob], token: int, atol: float) -> bool:
    return any(abs(lp.logprob - value) <= atol for t, lp in entries.items() if t != token)


def assert_same_up_to_a_near_tie(
    got: Sequence[RequestOutput],
    want: Sequence[RequestOutput],
    max_gap: float,
    logprob_atol: float | None = None,
) -> list[int | None]:
    """Greedy outputs of two pagoda runs that round differently (the caller states why, and the
    gap and tolerance that follow), held to the oracle's rules (tests/oracle.py) with `want`, the
    reference run, as the oracle: lengths and finish reasons always equal; at the first differing
    step a near tie only, judged on the reference's log-probs of both chosen tokens (so the
    other run's token must be among the reference's listed top-k), after at least
    MIN_EQUAL_TOKENS equal tokens; at most 1 in PROMPTS_PER_TIE prompts ending at a tie. With
    logprob_atol, each equal step's chosen-token log-prob within it of the reference's. The
    reference needs logprobs; both runs need ignore_eos (their lengths are compared after a
    tie). Returns each prompt's tie step (None: all equal)."""
    assert len(got) == len(want), f"{len(got)} outputs, expected {len(want)}"
    ties: list[int | None] = []
    for i, (g, w) in enumerate(zip(got, want)):
        gs, ws = g.outputs[0], w.outputs[0]
        assert ws.logprobs is not None, "the reference run needs logprobs"
        tie = _first_divergence(gs, ws, max_gap, logprob_atol, f"prompt {i}")
        assert len(gs.token_ids) == len(ws.token_ids), (
            f"prompt {i}: {len(gs.token_ids)} tokens, the reference {len(ws.token_ids)}"
        )
        assert gs.finish_reason == ws.finish_reason, (
            f"prompt {i}: finish reason {gs.finish_reason!r}, the reference {ws.finish_reason!r}"
        )
        ties.append(tie)
    assert_tie_budget(ties, f"equivalence (gap < {max_gap})")
    return ties


def _first_divergence(
    got: CompletionOutput,
    want: CompletionOutput,
    max_gap: float,
    logprob_atol: float | None,
    what: str,
) -> int | None:
    """The step of an accepted tie in one prompt, None if every compared token is equal."""
    assert want.logprobs is not None
    both = f"\n  got:  {got.token_ids}\n  want: {want.token_ids}"
    for step, (token, ref) in enumerate(zip(got.token_ids, want.token_ids)):
        listed = want.logprobs[step]
        if token == ref:
            if logprob_atol is not None:
                assert got.logprobs is not None, f"{what}: logprobs to compare"
                diff = abs(got.logprobs[step][token].logprob - listed[ref].logprob)
                assert diff <= logprob_atol, (
                    f"{what} step {step}: log-prob of {token} differs by {diff:.4f} "
                    f"(atol {logprob_atol})"
                )
            continue
        assert token in listed, (
            f"{what}: tokens differ at step {step}, and {token} is not among the reference's "
            f"listed log-probs: not a near tie{both}"
        )
        gap = listed[ref].logprob - listed[token].logprob
        assert gap < max_gap, (
            f"{what}: tokens differ at step {step}, gap {gap:.4f} >= {max_gap}{both}"
        )
        assert step >= MIN_EQUAL_TOKENS, (
            f"{what}: near tie at step {step} after only {step} equal tokens (a tie needs at "
            f"least {MIN_EQUAL_TOKENS}){both}"
        )
        print(f"equivalence: near tie accepted, {what}, step {step}, gap {gap:.4f}")
        return step
    return None
