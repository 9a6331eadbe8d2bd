"""Verification of draft tokens (runner/rejection_sampler.py) on fixed distributions (CPU).

Greedy acceptance is checked token for token. Sampling is checked for exactness with a
chi-square goodness-of-fit test: >= 100k rows, each verified once, and the emitted tokens at
each position compared with the target distribution there. There is no scipy in the test
install, so p-values come from the chi-square survival function in closed form, which exists
for an even number of degrees of freedom (a vocabulary of 5 tokens: 4), checked against
tabulated critical values. The same test must reject verifiers that are wrong on purpose, which
shows it has the power to catch a wrong one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from pagoda.runner.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    DraftLayout,
    VerifyOutput,
    accept_greedy,
    accept_prefixes,
    rejection_sample,
    rewind_generators,
    snapshot_generators,
)
from pagoda.runner.sampler import random_sample

P = PLACEHOLDER_TOKEN_ID


def layout(*ks: int) -> DraftLayout:
    return DraftLayout.build(list(ks), "cpu")


def ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def one_hot_rows(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    """(T, vocab) distributions whose argmax is `tokens` (and that sample them surely)."""
    return torch.nn.functional.one_hot(ids(tokens), vocab).float()


# ---------------------------------------------------------------- layout and greedy


def test_layout_offsets_and_indices() -> None:
    lay = layout(3, 0, 2)
    assert lay.target_starts == (0, 4, 5) and lay.draft_starts == (0, 3, 3)
    assert (lay.num_rows, lay.max_k, lay.num_target_rows) == (3, 3, 8)
    assert lay.target_index.tolist() == [[0, 1, 2, 3], [4, 4, 4, 4], [5, 6, 7, 7]]
    assert lay.draft_target_rows.tolist() == [0, 1, 2, 5, 6]
    assert lay.bonus_rows.tolist() == [3, 4, 7]
    assert lay.pad_drafts(ids([10, 11, 12, 13, 14])).tolist() == [
        [10, 11, 12],
        [P, P, P],
        [13, 14, P],
    ]
    assert lay.expand_rows(ids([7, 8, 9])).tolist() == [7, 7, 7, 7, 8, 9, 9, 9]


@pytest.mark.parametrize(
    "targets, drafts, emitted",
    [
        ([5, 6, 7, 8], [5, 6, 7], [5, 6, 7, 8]),  # all accepted: the bonus follows
        ([5, 6, 7, 8], [1, 6, 7], [5]),  # the first rejected: the target's token instead
        ([5, 6, 7, 8], [5, 1, 7], [5, 6]),  # mid rejection
        ([5, 6, 7, 8], [5, 6, 1], [5, 6, 7]),  # the last rejected
    ],
)
def test_greedy_one_row(targets: list[int], drafts: list[int], emitted: list[int]) -> None:
    out = accept_greedy(ids(targets), ids(drafts), layout(3))
    assert out.tolists() == [emitted]
    assert out.num_accepted.tolist() == [len(emitted) - 1]
    assert out.token_ids.tolist() == [emitted + [P] * (4 - len(emitted))]


def test_greedy_rows_with_different_k_and_plain_rows() -> None:
    lay = layout(3, 0, 2, 1, 0)
    # row:           r0 (k=3)      r1    r2 (k=2)   r3 (k=1)  r4
    targets = ids([1, 2, 3, 4, 20, 30, 31, 32, 40, 41, 50])
    drafts = ids([1, 2, 3, 30, 9, 40])
    out = accept_greedy(targets, drafts, lay)
    assert out.tolists() == [[1, 2, 3, 4], [20], [30, 31], [40, 41], [50]]
    assert out.num_accepted.tolist() == [3, 0, 1, 1, 0]
    assert out.token_ids.tolist() == [
        [1, 2, 3, 4],
        [20, P, P, P],
        [30, 31, P, P],
        [40, 41, P, P],
        [50, P, P, P],
    ]
    # the target row of every emitted token, rows in order: whose logits give its logprobs
    cols = torch.arange(lay.max_k + 1)
    emitted = lay.target_index[cols <= out.num_accepted.unsqueeze(1)]
    assert emitted.tolist() == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10]


def test_greedy_accepts_a_prefix_only() -> None:
    # draft 2 equals its target but comes after a rejection: not accepted
    out = accept_greedy(ids([5, 6, 7, 8]), ids([5, 0, 7]), layout(3))
    assert out.tolists() == [[5, 6]]


def test_host_acceptance_equals_accept_greedy() -> None:
    """accept_prefixes (the runner's, on the host) keeps what accept_greedy keeps: rows with 0
    to 5 drafts over a 3-token vocabulary, so every kind of prefix occurs."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        ks = torch.randint(0, 6, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g)
        drafts = [torch.randint(0, 3, (int(k),), generator=g).tolist() for k in ks]
        targets = torch.randint(0, 3, (int(ks.sum()) + len(drafts),), generator=g)
        want = accept_greedy(targets, ids([t for d in drafts for t in d]), layout(*ks.tolist()))
        assert accept_prefixes(targets.tolist(), drafts) == want.num_accepted.tolist()


def test_only_plain_rows_and_an_empty_batch() -> None:
    out = accept_greedy(ids([3, 4]), ids([]), layout(0, 0))
    assert out.tolists() == [[3], [4]] and out.token_ids.shape == (2, 1)
    empty = accept_greedy(ids([]), ids([]), layout())
    assert empty.token_ids.shape == (0, 1) and empty.tolists() == []


@pytest.mark.parametrize(
    "with_draft_probs, by_position", [(False, False), (False, True), (True, None)]
)
def test_greedy_rows_in_rejection_sample(with_draft_probs: bool, by_position: bool | None) -> None:
    """Greedy rows keep the argmax prefix whatever the draft's q, beside random rows."""
    lay = layout(2, 2)
    targets = one_hot_rows([1, 2, 3, 4, 5, 6])
    drafts = ids([1, 2, 4, 0])
    q = torch.full((4, 8), 1 / 8) if with_draft_probs else None
    greedy = torch.tensor([True, False])
    out = rejection_sample(
        targets, drafts, lay, {}, greedy=greedy, draft_probs=q, by_position=by_position
    )
    # a random row on one-hot targets is certain too: draft 4 has p = 1, draft 0 has p = 0
    assert out.tolists() == [[1, 2, 3], [4, 5]]


# ---------------------------------------------------------------- chi-square


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df), df even: exp(-x/2) * sum_{i<df/2} (x/2)^i/i!."""
    assert df % 2 == 0 and df > 0
    half = statistic / 2
    term, total = 1.0, 1.0
    for i in range(1, df // 2):
        term *= half / i
        total += term
    return math.exp(-half) * total


def test_chi2_sf_against_tables() -> None:
    # Critical values at 0.05 and 0.01 (standard tables), df = 2, 4, 6.
    for x, df, p in [(5.991, 2, 0.05), (9.210, 2, 0.01), (9.488, 4, 0.05), (13.277, 4, 0.01)]:
        assert chi2_sf(x, df) == pytest.approx(p, rel=1e-3)
    assert chi2_sf(16.812, 6) == pytest.approx(0.01, rel=1e-3)
    assert chi2_sf(0.0, 4) == 1.0


def chi2_p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of the sampled `tokens` (N,) to `probs` (V,), all of them > 0."""
    vocab = probs.shape[0]
    observed = torch.bincount(tokens, minlength=vocab).double()
    expected = probs.double() * tokens.shape[0]
    assert expected.min() >= 50
    return chi2_sf(float(((observed - expected) ** 2 / expected).sum()), vocab - 1)


N = 120_000
VOCAB = 5
K = 2
# Target and draft distributions per position, all different (a draft that is often wrong).
TARGET = torch.tensor(
    [
        [0.40, 0.25, 0.15, 0.12, 0.08],
        [0.05, 0.15, 0.50, 0.20, 0.10],
        [0.20, 0.20, 0.20, 0.20, 0.20],
    ]
)
DRAFT = torch.tensor(
    [
        [0.10, 0.40, 0.05, 0.25, 0.20],
        [0.30, 0.10, 0.40, 0.10, 0.10],
    ]
)

Verifier = Callable[[torch.Tensor, torch.Tensor, DraftLayout, torch.Tensor], VerifyOutput]


def draw_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, DraftLayout, torch.Tensor]:
    """N rows with k = 2 drafts sampled from DRAFT: (target probs (3N, V), drafts (2N,), layout,
    draft probs (2N, V)). The drafts come from their own generator; the verifier's noise from
    the default one, seeded differently (with equal seeds both streams are the same numbers,
    and drafts would correlate with the acceptance draws)."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(DRAFT, N, replacement=True, generator=g).t().reshape(-1)
    target_probs = TARGET.repeat(N, 1)
    draft_probs = DRAFT.repeat(N, 1)
    return target_probs, drafts, DraftLayout.build([K] * N, "cpu"), draft_probs


def exact_with_draft_probs(p: torch.Tensor, d: torch.Tensor, lay: DraftLayout, q: torch.Tensor):
    return rejection_sample(p, d, lay, {}, draft_probs=q)


def exact_deterministic(p: torch.Tensor, d: torch.Tensor, lay: DraftLayout, q: torch.Tensor):
    # The drafts are treated as one-hot: exact whatever produced them (here: samples of q).
    return rejection_sample(p, d, lay, {}, by_position=False)


def exact_by_position(p: torch.Tensor, d: torch.Tensor, lay: DraftLayout, q: torch.Tensor):
    return rejection_sample(p, d, lay, {}, by_position=True)


def wrong_always_accept(p: torch.Tensor, d: torch.Tensor, lay: DraftLayout, q: torch.Tensor):
    bonus = torch.multinomial(p[lay.bonus_rows], 1).squeeze(1)
    tokens = torch.cat([lay.pad_drafts(d), bonus.unsqueeze(1)], dim=1)
    return VerifyOutput(tokens, torch.full((lay.num_rows,), K))


def emitted_at(out: VerifyOutput, position: int) -> torch.Tensor:
    """The tokens emitted at `position` by the rows that got that far."""
    reached = out.num_accepted >= position
    return out.token_ids[reached, position]


@pytest.mark.parametrize(
    "verifier", [exact_with_draft_probs, exact_deterministic, exact_by_position]
)
def test_sampling_is_distribution_exact(verifier: Verifier) -> None:
    torch.manual_seed(1234)
    out = verifier(*draw_batch(seed=0))
    for position in range(K + 1):
        tokens = emitted_at(out, position)
        assert tokens.shape[0] > 5000
        p_value = chi2_p_value(tokens, TARGET[position])
        assert p_value > 0.01, f"position {position}: p = {p_value:.3g}"
    # drafts were rejected at once in many rows and all accepted in many
    assert (out.num_accepted == 0).sum() > N // 10 and (out.num_accepted == K).sum() > N // 50


def resample_from_target(p: torch.Tensor, d: torch.Tensor, lay: DraftLayout, q: torch.Tensor):
    """The classic slip: after a rejection, draw from p itself instead of max(0, p - q)."""
    right = rejection_sample(p, d, lay, {}, draft_probs=q)
    fresh = torch.multinomial(p, 1).squeeze(1)[lay.target_index]  # (R, K + 1)
    cols = torch.arange(K + 1)
    at_reject = (cols == right.num_accepted.unsqueeze(1)) & (right.num_accepted < K).unsqueeze(1)
    return VerifyOutput(torch.where(at_reject, fresh, right.token_ids), right.num_accepted)


@pytest.mark.parametrize("verifier", [wrong_always_accept, resample_from_target])
def test_chi_square_catches_a_wrong_verifier(verifier: Verifier) -> None:
    torch.manual_seed(1234)
    out = verifier(*draw_batch(seed=0))
    p_value = chi2_p_value(emitted_at(out, 0), TARGET[0])
    assert p_value < 1e-6, f"p = {p_value:.3g}: the test cannot tell this verifier is wrong"


# ---------------------------------------------------------------- seeds


def random_probs(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(rows, vocab, generator=g).pow_(3).softmax(dim=-1)


@pytest.mark.parametrize(
    "with_draft_probs, by_position", [(False, False), (False, True), (True, None)]
)
def test_seeded_rows_are_reproducible_and_batch_independent(
    with_draft_probs: bool, by_position: bool | None
) -> None:
    vocab = 6
    lay = layout(3, 1, 2)
    probs = random_probs(lay.num_target_rows, vocab, seed=3)
    drafts = ids([0, 1, 2, 3, 4, 5])
    q = random_probs(6, vocab, seed=4) if with_draft_probs else None

    def run(seeds: dict[int, int]) -> list[list[int]]:
        gens = {row: torch.Generator().manual_seed(s) for row, s in seeds.items()}
        return rejection_sample(
            probs, drafts, lay, gens, draft_probs=q, by_position=by_position
        ).tolists()

    first = run({0: 7, 2: 8})
    for _ in range(5):
        torch.rand(100)  # the default generator moves; seeded rows do not care
        again = run({0: 7, 2: 8})
        assert again[0] == first[0] and again[2] == first[2]
    # Row 0's tokens depend on its seed only, not on which other rows are seeded.
    assert run({0: 7})[0] == first[0]


def plain_decode(probs: torch.Tensor, drafts: list[int], g: torch.Generator) -> list[int]:
    """Decoding without speculation, one token per step with the plain sampler, as long as the
    tokens equal the drafts (the target rows hold the distributions after those drafts)."""
    tokens: list[int] = []
    for i in range(probs.shape[0]):
        token = int(random_sample(probs[i : i + 1].clone(), {0: g})[0])
        tokens.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
    return tokens


@pytest.mark.parametrize("by_position", [False, True])
@pytest.mark.parametrize("num_matching", [0, 1, 2, 3])
def test_seeded_speculation_equals_plain_decoding(num_matching: int, by_position: bool) -> None:
    """Deterministic drafts on a seeded row: the plain sampler's tokens, and its generator left
    where plain decoding leaves it (so the following steps agree too)."""
    vocab, k = 7, 3
    probs = random_probs(k + 1, vocab, seed=11)
    plain_g = torch.Generator().manual_seed(99)
    # Drafts equal to what plain decoding samples for num_matching positions, then wrong.
    g = torch.Generator().manual_seed(99)
    drafts: list[int] = []
    for i in range(k):
        token = int(random_sample(probs[i : i + 1].clone(), {0: g})[0])
        drafts.append(token if i < num_matching else (token + 1) % vocab)
    expected = plain_decode(probs, drafts, plain_g)
    assert len(expected) == num_matching + 1

    spec_g = torch.Generator().manual_seed(99)
    lay = layout(k)
    out = rejection_sample(probs, ids(drafts), lay, {0: spec_g}, by_position=by_position)
    assert out.tolists() == [expected]
    assert out.num_accepted.tolist() == [min(num_matching, k)]
    assert torch.equal(spec_g.get_state(), plain_g.get_state())

    # The same through the plain sampler over all k + 1 rows, then accept_greedy and a rewind.
    sampler_g = torch.Generator().manual_seed(99)
    snapshots = snapshot_generators({0: sampler_g})
    tokens = random_sample(probs.clone(), lay.expand_generators({0: sampler_g}))
    out2 = accept_greedy(tokens, ids(drafts), lay)
    assert out2.tolists() == [expected]
    rewind_generators({0: sampler_g}, snapshots, out2.num_accepted.tolist(), vocab)
    assert torch.equal(sampler_g.get_state(), plain_g.get_state())


def test_both_ways_agree_on_greedy_and_seeded_rows() -> None:
    """A mixed batch: greedy, seeded and unseeded random rows, different k, plain rows."""
    vocab = 5
    lay = layout(4, 0, 3, 2, 4, 1)
    probs = random_probs(lay.num_target_rows, vocab, seed=5)
    g = torch.Generator().manual_seed(6)
    drafts = torch.randint(0, 2, (sum(lay.num_draft_tokens),), generator=g)  # often right
    greedy = torch.tensor([True, False, False, True, False, False])
    results, states = [], []
    for by_position in (False, True):
        gens = {1: torch.Generator().manual_seed(1), 2: torch.Generator().manual_seed(2)}
        gens[4] = torch.Generator().manual_seed(4)
        out = rejection_sample(probs, drafts, lay, gens, greedy=greedy, by_position=by_position)
        results.append(out.tolists())
        states.append({row: gen.get_state() for row, gen in gens.items()})
    deterministic = [0, 1, 2, 3, 4]  # row 5 is random without a seed
    assert [results[0][r] for r in deterministic] == [results[1][r] for r in deterministic]
    assert all(torch.equal(states[0][r], states[1][r]) for r in states[0])
    assert sum(len(row) for row in results[0]) > lay.num_rows + 2  # some drafts held
