"""DraftModelProposer's bookkeeping, host only: what it feeds the draft at which positions
(catch-up in passes under the token cap, then one token a step), what stays valid after a
verification, backoff, allowances, and forgetting a preempted request. The draft is a fake
that records its rows and predicts t + 1."""

from __future__ import annotations

from typing import Any

from pagoda.spec_decode.draft_model import DraftModelProposer
from pagoda.speculative_config import SpeculativeConfig


class FakeDraft:
    """A DraftStepFn whose greedy next token is the last fed token + 1, recording each step."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, list[int], int]]] = []

    def __call__(self, rows: list[tuple[str, list[int], int]]) -> list[int]:
        self.steps.append([(rid, list(tokens), start) for rid, tokens, start in rows])
        return [tokens[-1] + 1 for _, tokens, _ in rows]


def proposer(
    k: int = 3, max_step_tokens: int = 64, shared: bool = False, **fields: Any
) -> tuple[DraftModelProposer, FakeDraft]:
    config = SpeculativeConfig(num_speculative_tokens=k, method="draft_model", model="d", **fields)
    draft = FakeDraft()
    ratio = config.catch_up_ratio("cpu")
    return DraftModelProposer(config, draft, max_step_tokens, shared, ratio), draft


def test_catch_up_then_one_token_steps() -> None:
    p, draft = proposer(k=3)
    tokens = list(range(10, 20))
    assert p.propose([("a", tokens, 8)]) == [[20, 21, 22]]
    # the whole prompt first, then d1 at position 10 and d2 at 11 (d3 is never fed)
    assert draft.steps == [[("a", tokens, 0)], [("a", [20], 10)], [("a", [21], 11)]]
    assert p.valid["a"] == 10


def test_accepted_drafts_stay_valid() -> None:
    p, draft = proposer(k=3)
    tokens = list(range(10, 20))
    p.propose([("a", tokens, 8)])
    p.record("a", 3, 1)  # d1 = 20 held, then the target's own token 99
    assert p.valid["a"] == 11  # d1's KV (fed at 10) was computed from true tokens
    draft.steps.clear()
    p.propose([("a", [*tokens, 20, 99], 8)])
    assert draft.steps[0] == [("a", [99], 11)]  # only the target's token is fed again
    p.record("a", 3, 3)  # every draft held: d3 was never fed, so it is fed next time
    assert p.valid["a"] == 12 + 2
    draft.steps.clear()
    p.propose([("a", [*tokens, 20, 99, 100, 101, 102, 7], 8)])
    assert draft.steps[0] == [("a", [102, 7], 14)]


def test_catch_up_passes_respect_the_token_cap() -> None:
    p, draft = proposer(k=2, max_step_tokens=4)
    a, b = list(range(100, 106)), [7, 8, 9]
    assert p.propose([("a", a, 5), ("b", b, 5)]) == [[106, 107], [10, 11]]
    catch_up = draft.steps[:3]
    assert catch_up == [
        [("a", a[:4], 0)],
        [("a", a[4:], 4), ("b", b[:2], 0)],
        [("b", b[2:], 2)],
    ]
    assert all(sum(len(t) for _, t, _ in step) <= 4 for step in draft.steps)
    assert draft.steps[3] == [("a", [106], 6), ("b", [10], 3)]


def test_allowance_backoff_and_remove() -> None:
    p, draft = proposer(k=4, max_backoff_steps=4)
    tokens = [1, 2, 3]
    # at most `allowed` drafts; none for a request that may not grow
    assert p.propose([("a", tokens, 2), ("b", tokens, 0)]) == [[4, 5], []]
    p.backoff.record("a", 2, 0)  # an earlier verification rejected every draft
    p.record("a", 2, 0)  # all rejected again: a pauses one step
    draft.steps.clear()
    assert p.propose([("a", [*tokens, 9], 4)]) == [[]]
    assert draft.steps == []  # nothing to feed, no forward run
    assert p.propose([("a", [*tokens, 9], 4)]) == [[10, 11, 12, 13]]
    # the rejected pass fed 4 at position 3; the true token there is 9, fed again
    assert draft.steps[0] == [("a", [9], 3)]
    p.remove("a")  # preempted: its blocks are gone
    draft.steps.clear()
    p.propose([("a", [*tokens, 9], 4)])
    assert draft.steps[0] == [("a", [*tokens, 9], 0)]


def test_a_draft_on_the_target_cache_feeds_only_the_last_token() -> None:
    """A self-draft reads the target's KV, valid below the last token: no prompt catch-up."""
    p, draft = proposer(k=3, shared=True)
    tokens = list(range(10, 20))
    assert p.propose([("a", tokens, 8)]) == [[20, 21, 22]]
    assert draft.steps == [[("a", [19], 9)], [("a", [20], 10)], [("a", [21], 11)]]
    p.backoff.record("a", 3, 0)  # an earlier verification rejected every draft
    p.record("a", 3, 0)  # all rejected again: one step of backoff
    assert p.propose([("a", [*tokens, 5], 8)]) == [[]]
    draft.steps.clear()
    p.propose([("a", [*tokens, 5, 6], 8)])
    assert draft.steps[0] == [("a", [6], 11)]


def test_no_catch_up_that_feeds_more_than_the_ratio_per_token_left() -> None:
    """max_catch_up_ratio ("auto": 2 on CPU): a request joins speculation only while the tokens
    its draft must feed are at most the ratio times the tokens it may still produce."""
    p, draft = proposer(k=3)
    context = list(range(1, 21))  # 20 tokens to feed
    # 9 left (8 drafts allowed + the target's token): 20 > 2 * 9, passed over, nothing run
    assert p.propose([("a", context, 8), ("b", context[:18], 8)]) == [[], [19, 20, 21]]
    assert draft.steps[0] == [("b", context[:18], 0)]  # only b (18 <= 18) caught up
    assert p.num_catch_ups_declined == 1 and "a" not in p.valid
    assert p.propose([("a", context, 9)]) == [[21, 22, 23]]  # 20 <= 2 * 10
    # once caught up, a request feeds only the tokens since: never passed over again
    p.record("a", 3, 0)
    assert p.propose([("a", [*context, 5], 0)]) == [[]]  # nothing allowed
    assert p.propose([("a", [*context, 5, 6], 1)]) == [[7]]
    assert p.num_catch_ups_declined == 1


def test_catch_up_ratio_none_always_catches_up() -> None:
    p, draft = proposer(k=2, max_catch_up_ratio=None)
    assert p.propose([("a", list(range(1, 101)), 1)]) == [[101]]
    assert p.num_catch_up_tokens == 100 and len(draft.steps) == 2  # two passes of <= 64
    q, _ = proposer(k=2, shared=True)  # a self-draft feeds one token: always worth it
    assert q.propose([("a", list(range(1, 101)), 1)]) == [[101]]
