"""NgramProposer: prompt lookup as vLLM's NgramProposer matches, the allowance cap, the
growing per-request context, and per-request backoff (host only, no model)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagoda.spec_decode.backoff import ProposalBackoff
from pagoda.spec_decode.ngram import NgramProposer, TokenIds, find_ngram_draft
from pagoda.speculative_config import SpeculativeConfig


def draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return find_ngram_draft(np.array(tokens, dtype=np.int64), min_n, max_n, k).tolist()


def reference_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, by brute force: the longest suffix n-gram (max_n down to min_n) with an
    earlier occurrence; the k tokens after its earliest occurrence."""
    total = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[total - n :] if n < total else None
        for start in range(total - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_vllm_docstring_example() -> None:
    # vLLM's NgramProposer.propose: [1,2,3,4,2,3], min 2, max 3, k 4 -> [4, 2, 3]
    assert draft([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]


def test_no_match_proposes_nothing() -> None:
    assert draft([1, 2, 3, 4, 5], 1, 3, 4) == []
    assert draft([7], 1, 1, 4) == []
    assert draft([], 1, 2, 4) == []


def test_longest_ngram_wins_over_an_earlier_shorter_one() -> None:
    tokens = [9, 2, 3, 5, 1, 2, 3, 7, 1, 2, 3]
    assert draft(tokens, 2, 3, 4) == [7, 1, 2, 3]  # the 3-gram 1 2 3 at 4
    assert draft(tokens, 2, 2, 4) == [5, 1, 2, 3]  # max 2: the 2-gram 2 3 first occurs at 1


def test_earliest_occurrence_of_the_longest_ngram() -> None:
    # vLLM keeps the earliest position among matches of the longest length.
    assert draft([1, 2, 8, 1, 2, 9, 1, 2], 2, 2, 2) == [8, 1]


def test_min_n_refuses_short_matches() -> None:
    tokens = [4, 5, 6, 1, 7, 8, 1]  # only the 1-gram "1" occurs earlier
    assert draft(tokens, 1, 3, 2) == [7, 8]
    assert draft(tokens, 2, 3, 2) == []


def test_draft_stops_at_the_end_and_may_overlap_the_suffix() -> None:
    assert draft([5, 5, 5, 5], 2, 2, 4) == [5, 5]  # 5 5 at 0, followed by t[2:4]
    assert draft([1, 2, 3, 1, 2], 2, 2, 10) == [3, 1, 2]


@pytest.mark.parametrize("seed", range(4))
def test_matches_the_definition_on_random_contexts(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        tokens = [rng.randrange(rng.choice([2, 3, 6, 40])) for _ in range(rng.randint(0, 50))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 5)
        assert draft(tokens, min_n, max_n, k) == reference_draft(tokens, min_n, max_n, k)


def test_k_and_the_allowance_cap_the_draft() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2)
    assert p.propose([("a", tokens, 10)]) == [[3, 4, 5]]  # k = 3
    assert p.propose([("a", tokens, 2)]) == [[3, 4]]  # the caller's allowance
    assert p.propose([("a", tokens, 0)]) == [[]]  # max_tokens or max_model_len reached
    assert p.propose([("a", tokens, -1)]) == [[]]


def test_batch_keeps_order_and_takes_numpy_rows() -> None:
    p = NgramProposer(2, 1, 3)
    rows: list[tuple[str, TokenIds, int]] = [
        ("a", [1, 2, 3, 1, 2], 8),
        ("b", [9, 8, 7], 8),
        ("c", np.array([4, 4, 4, 4], dtype=np.int32), 8),
    ]
    assert p.propose(rows) == [[3, 1], [], [4]]  # 4 4 4 at 0, then t[3]


def test_growing_context_matches_a_fresh_proposer() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(5) for _ in range(20)]
    growing = NgramProposer(3, 2, 4, max_backoff_steps=0)
    for _ in range(200):
        tokens.append(rng.randrange(5))
        fresh = NgramProposer(3, 2, 4, max_backoff_steps=0).propose([("r", list(tokens), 3)])
        assert growing.propose([("r", tokens, 3)]) == fresh
    # Not an extension of what the proposer saw for "r" (e.g. a reused id): copied afresh.
    other = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 9, 2]
    assert growing.propose([("r", other, 3)]) == [[6, 5, 3]]


def test_from_config() -> None:
    config = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    )
    assert config is not None
    p = NgramProposer.from_config(config)
    assert (p.k, p.min_n, p.max_n, p.backoff.max_steps) == (2, 1, 1, config.max_backoff_steps)


# ---------------------------------------------------------------- backoff


def test_backoff_pauses_grow_and_reset_on_success() -> None:
    b = ProposalBackoff(max_steps=5)

    def pause() -> int:
        skipped = 0
        while not b.allow("r"):
            skipped += 1
        return skipped

    b.record("r", 4, 0)
    assert pause() == 0  # one failure alone does not pause (GRACE)
    b.record("r", 4, 0)
    assert pause() == 1
    b.record("r", 4, 0)
    assert pause() == 3
    b.record("r", 2, 0)
    assert pause() == 5  # 7, capped at max_steps
    b.record("r", 2, 0)
    assert pause() == 5
    b.record("r", 3, 1)  # an accepted draft: no pause, and the failures start over
    assert pause() == 0
    b.record("r", 3, 0)
    assert pause() == 0
    b.record("r", 3, 0)
    assert pause() == 1


def test_backoff_ignores_steps_without_drafts_and_can_be_off() -> None:
    b = ProposalBackoff(max_steps=8)
    b.record("r", 0, 0)
    assert b.allow("r") and b.skip_left("r") == 0
    off = ProposalBackoff(max_steps=0)
    for _ in range(10):
        off.record("r", 4, 0)
        assert off.allow("r")


def test_proposer_backs_off_per_request() -> None:
    p = NgramProposer(2, 1, 1, max_backoff_steps=16)
    rows = [("bad", [1, 2, 1], 8), ("good", [3, 4, 3], 8)]
    assert p.propose(rows) == [[2, 1], [4, 3]]
    p.record("bad", 2, 0)
    p.record("good", 2, 2)
    assert p.propose(rows) == [[2, 1], [4, 3]]  # one failure: no pause yet
    p.record("bad", 2, 0)
    p.record("good", 2, 2)
    assert p.propose(rows) == [[], [4, 3]]  # two in a row: bad pauses one step
    assert p.propose(rows) == [[2, 1], [4, 3]]
    p.record("bad", 2, 0)
    assert [p.propose(rows)[0] for _ in range(4)] == [[], [], [], [2, 1]]  # then three
    p.remove("bad")
    assert p.backoff.skip_left("bad") == 0
    p.record("bad", 2, 0)
    p.record("bad", 2, 0)
    assert p.propose(rows)[0] == []


def test_random_text_soon_costs_nothing() -> None:
    """On random tokens every proposal fails; with backoff a request proposes in few steps."""
    rng = random.Random(1)
    tokens = [rng.randrange(4) for _ in range(64)]  # 4 symbols: n-grams match often
    p = NgramProposer(4, 1, 2, max_backoff_steps=32)
    proposed_steps = 0
    for _ in range(200):
        (d,) = p.propose([("r", tokens, 4)])
        nxt = rng.randrange(4)
        if d:
            proposed_steps += 1
            accepted = 0 if d[0] != nxt else 1  # pretend: only the first can be checked
            p.record("r", len(d), accepted)
        tokens.append(nxt)
    assert proposed_steps < 60
