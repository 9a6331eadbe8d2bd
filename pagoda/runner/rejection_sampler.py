"""Exact verification of draft tokens: greedy prefix acceptance and rejection sampling.

Layout. A step verifies R rows (requests); row r brings k_r >= 0 draft tokens and its target
distributions at k_r + 1 positions. Inputs are flattened, rows in order (vLLM's layout):

    target rows (T = sum(k_r + 1)):  | r0: d0 d1 d2 bonus | r1: bonus | r2: d0 bonus |
    draft rows  (D = sum(k_r)):      | r0: d0 d1 d2       |           | r2: d0       |

Target row i of r holds the target's distribution after the tokens up to draft i - 1, so it
verifies draft i; row k_r is the bonus position, after all of r's drafts. A row with k_r = 0
is a plain row: it emits the token of its one target row. Outputs are padded, (R, max_k + 1):
row r emits token_ids[r, : num_accepted[r] + 1] (the accepted drafts, then the target's own
token at the first rejection, or the bonus after all k_r were accepted) and holds
PLACEHOLDER_TOKEN_ID after them.

Deterministic drafts (n-gram, a greedy draft model) are one-hot q. Rejection sampling then is:
accept x with probability p(x), else draw from p with x removed, renormalized. Drawing y ~ p and
accepting x iff y == x does exactly that (P(y = x) = p(x); given y != x, y ~ p without x), so
these rows sample every target position with the plain sampler's exponential race and keep the
longest prefix of drafts equal to the samples, like greedy rows do with the argmax. A seeded row
draws its noise position by position from its generator, as the plain sampler draws one
vocabulary-sized row per token, and its generator is left as after num_accepted + 1 draws: the
same tokens and generator state as decoding without speculation, given the same target rows.
Positions are sampled either one after another, only for rows whose drafts held so far (work
per emitted token; the default on CPU), or all at once, then seeded generators are rewound.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pagoda.runner.sampler import exponential_race

PLACEHOLDER_TOKEN_ID = -1  # pads token_ids after a row's emitted tokens; never a token id


def _on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`; on CUDA through pinned memory, without waiting for the
    device."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True, eq=False)
class DraftLayout:
    """Where each row's drafts and target positions lie in the flattened inputs (see above).

    Index tensors live on `device`; `num_draft_tokens` and the offsets stay on the host.
    """

    num_draft_tokens: tuple[int, ...]  # k_r per row
    target_starts: tuple[int, ...]  # first target row of each row
    draft_starts: tuple[int, ...]  # first draft row of each row
    num_drafts: torch.Tensor  # (R,) int64: k_r
    target_index: torch.Tensor  # (R, max_k + 1) target row of (r, i); i > k_r repeats k_r
    draft_index: torch.Tensor  # (R, max_k) draft row of (r, i); meaningful where draft_valid
    draft_valid: torch.Tensor  # (R, max_k) bool: i < k_r
    draft_target_rows: torch.Tensor  # (D,) the target row that verifies each draft
    bonus_rows: torch.Tensor  # (R,) target row k_r of each row
    target_row_owner: torch.Tensor  # (T,) the row each target row belongs to

    @classmethod
    def build(cls, num_draft_tokens: Sequence[int], device: torch.device | str) -> DraftLayout:
        device = torch.device(device)
        k = np.asarray(num_draft_tokens, dtype=np.int64).reshape(-1)
        assert (k >= 0).all()
        max_k, num_drafts = int(k.max(initial=0)), int(k.sum())
        target_starts = np.cumsum(k + 1) - (k + 1)
        draft_starts = np.cumsum(k) - k
        cols = np.arange(max_k + 1)
        target_index = target_starts[:, None] + np.minimum(cols, k[:, None])
        draft_valid = cols[:max_k] < k[:, None]
        draft_index = np.minimum(draft_starts[:, None] + cols[:max_k], max(num_drafts - 1, 0))

        def tensor(values: np.ndarray) -> torch.Tensor:
            return _on_device(torch.from_numpy(np.ascontiguousarray(values)), device)

        return cls(
            num_draft_tokens=tuple(k.tolist()),
            target_starts=tuple(target_starts.tolist()),
            draft_starts=tuple(draft_starts.tolist()),
            num_drafts=tensor(k),
            target_index=tensor(target_index),
            draft_index=tensor(draft_index),
            draft_valid=tensor(draft_valid),
            draft_target_rows=tensor(target_index[:, :max_k][draft_valid]),
            bonus_rows=tensor(target_starts + k),
            target_row_owner=tensor(np.repeat(np.arange(k.shape[0]), k + 1)),
        )

    @property
    def num_rows(self) -> int:
        return len(self.num_draft_tokens)

    @property
    def max_k(self) -> int:
        return max(self.num_draft_tokens, default=0)

    @property
    def num_target_rows(self) -> int:
        return sum(self.num_draft_tokens) + self.num_rows

    def pad_drafts(self, draft_token_ids: torch.Tensor) -> torch.Tensor:
        """(D,) draft ids -> (R, max_k), PLACEHOLDER_TOKEN_ID after each row's k_r."""
        if self.max_k == 0:
            return self.draft_valid.new_empty((self.num_rows, 0), dtype=torch.int64)
        padded = draft_token_ids.long()[self.draft_index]
        return padded.masked_fill_(~self.draft_valid, PLACEHOLDER_TOKEN_ID)

    def expand_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row values (R, ...) -> per-target-row values (T, ...): row r's k_r + 1 times
        (e.g. a row's temperature for each position it samples)."""
        return values.index_select(0, self.target_row_owner)

    def expand_generators(
        self, generators: Mapping[int, torch.Generator]
    ) -> dict[int, torch.Generator]:
        """row -> generator as target row -> generator, each row's positions in order (a
        sampler that draws its seeded rows in key order then draws them position by position)."""
        return {
            self.target_starts[row] + i: g
            for row, g in sorted(generators.items())
            for i in range(self.num_draft_tokens[row] + 1)
        }


class VerifyOutput(NamedTuple):
    """Row r emits token_ids[r, : num_accepted[r] + 1]; PLACEHOLDER_TOKEN_ID after."""

    token_ids: torch.Tensor  # (R, max_k + 1) int64
    num_accepted: torch.Tensor  # (R,) int64: accepted drafts, 0 <= a_r <= k_r

    def tolists(self) -> list[list[int]]:
        """The emitted tokens of each row (one read of the device)."""
        return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in self.token_ids.tolist()]


def accept_greedy(
    target_token_ids: torch.Tensor, draft_token_ids: torch.Tensor, layout: DraftLayout
) -> VerifyOutput:
    """Keep each row's longest prefix of drafts equal to the target's tokens, then the target's
    token after it. target_token_ids: (T,) the target's token at every target row (the argmax
    of the processed logits for greedy rows; for deterministic drafts on random rows, a sample
    of the plain sampler at every position, see the module docstring). draft_token_ids: (D,)."""
    targets = target_token_ids.long()[layout.target_index]  # (R, max_k + 1)
    drafts = layout.pad_drafts(draft_token_ids)  # (R, max_k)
    matches = (drafts == targets[:, : layout.max_k]).long()
    num_accepted = matches.cumprod(dim=1).sum(dim=1)
    return VerifyOutput(_emit(targets, num_accepted), num_accepted)


def accept_prefixes(targets: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[int]:
    """accept_greedy on the host, for a step that reads its samples back anyway: a_r, the
    number of row r's drafts equal to the target's tokens before the first that is not.
    targets: (T,) the target's token at every target row, rows in order (row r's k_r + 1
    positions, k_r = len(drafts[r]))."""
    accepted = []
    start = 0
    for row in drafts:
        a = 0
        while a < len(row) and row[a] == targets[start + a]:
            a += 1
        accepted.append(a)
        start += len(row) + 1
    return accepted


def _emit(tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """(R, max_k + 1) tokens with PLACEHOLDER_TOKEN_ID after each row's num_accepted + 1."""
    cols = torch.arange(tokens.shape[1], device=tokens.device)
    return tokens.masked_fill(cols > num_accepted.unsqueeze(1), PLACEHOLDER_TOKEN_ID)


def _noise(
    shape: tuple[int, ...],
    like: torch.Tensor,
    segments: Mapping[int, tuple[int, int]],
    generators: Mapping[int, torch.Generator],
) -> torch.Tensor:
    """Uniform[0, 1) noise of `shape` on like's device. Rows start..end - 1 of each seeded row
    (segments[row] = (start, end)) come from that row's generator, one (shape[1:]) slice per
    call, in order; the other rows from the default generator."""
    uniform = like.new_empty(shape, dtype=torch.float32)
    if sum(segments[row][1] - segments[row][0] for row in generators) < shape[0]:
        uniform.uniform_()
    for row, g in generators.items():
        start, end = segments[row]
        for i in range(start, end):
            uniform[i].uniform_(generator=g)
    return uniform


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    layout: DraftLayout,
    generators: Mapping[int, torch.Generator],
    greedy: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    by_position: bool | None = None,
    greedy_token_ids: torch.Tensor | None = None,
) -> VerifyOutput:
    """Verify drafts so each row's emitted tokens are distributed as sampling the target.

    target_probs: (T, V) float32, the plain sampler's final distribution at every target row
        (after penalties, temperature, top-k, top-p, min-p; row sums need not be exactly 1).
        Greedy rows read only its argmax, so their rows may hold the processed logits.
    draft_token_ids: (D,) int. draft_probs: (D, V) the draft's distribution q at each draft,
        or None for deterministic drafts (one-hot q: n-gram, a greedy draft model).
    generators: row -> generator for seeded random rows (none for greedy rows).
    greedy: (R,) bool, the rows to verify by argmax; None when no row is greedy.
    greedy_token_ids: (T,) the argmax of the processed logits (the plain sampler's greedy
        token), for greedy rows with draft_probs; None: target_probs' argmax.

    With draft_probs, a draft x is accepted with probability min(1, p(x) / q(x)); at the first
    rejection the token is drawn from max(0, p - q) normalized; after k_r acceptances the bonus
    is drawn from the bonus row's p. A seeded row then draws, in order, k_r acceptance uniforms,
    k_r residual noise rows and one bonus noise row, so it is reproducible from its seed.

    Without draft_probs there are two ways to sample, with the same tokens for greedy and seeded
    rows. by_position samples position 0 of every row, then position 1 of the rows whose draft
    0 held, and so on: work per emitted token, as without speculation, but a read of the device
    per position (the default on CPU, where reads are free). Otherwise every target row is
    sampled at once and seeded rows with drafts cost one read (of their accepted counts, to
    rewind their generators); the default on CUDA.
    """
    if draft_probs is None:
        if by_position is None:
            by_position = target_probs.device.type == "cpu"
        if by_position:
            return _sample_by_position(target_probs, draft_token_ids, layout, generators, greedy)
        return _sample_all_positions(target_probs, draft_token_ids, layout, generators, greedy)
    sampled = _sample_with_draft_probs(
        target_probs, draft_token_ids, draft_probs, layout, generators
    )
    if greedy is None:
        return sampled
    if greedy_token_ids is None:
        greedy_token_ids = target_probs.argmax(dim=-1)
    argmax = accept_greedy(greedy_token_ids, draft_token_ids, layout)
    return VerifyOutput(
        torch.where(greedy.unsqueeze(1), argmax.token_ids, sampled.token_ids),
        torch.where(greedy, argmax.num_accepted, sampled.num_accepted),
    )


def _sample_all_positions(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    layout: DraftLayout,
    generators: Mapping[int, torch.Generator],
    greedy: torch.Tensor | None,
) -> VerifyOutput:
    """Sample every target row (the race; argmax for greedy rows), keep the matching prefix,
    leave each seeded generator as after a_r + 1 of its row's draws."""
    uniform = target_probs.new_empty(target_probs.shape, dtype=torch.float32)
    if sum(layout.num_draft_tokens[row] + 1 for row in generators) < uniform.shape[0]:
        uniform.uniform_()
    states: dict[int, list[torch.Tensor]] = {}
    for row, g in generators.items():
        start, k = layout.target_starts[row], layout.num_draft_tokens[row]
        states[row] = []
        for i in range(k + 1):
            uniform[start + i].uniform_(generator=g)
            if i < k:
                states[row].append(g.get_state())
    tokens = exponential_race(target_probs, uniform)
    if greedy is not None:
        is_greedy = layout.expand_rows(greedy)
        tokens = torch.where(is_greedy, target_probs.argmax(dim=-1), tokens)
    out = accept_greedy(tokens, draft_token_ids, layout)
    rewind = [row for row in states if layout.num_draft_tokens[row] > 0]
    if rewind:
        accepted = out.num_accepted[rewind].tolist()
        for row, a in zip(rewind, accepted):
            if a < layout.num_draft_tokens[row]:
                generators[row].set_state(states[row][a])
    return out


def _sample_by_position(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    layout: DraftLayout,
    generators: Mapping[int, torch.Generator],
    greedy: torch.Tensor | None,
) -> VerifyOutput:
    """Sample position i only for the rows whose drafts 0..i-1 all held; each seeded row draws
    exactly one noise row per emitted token, so its generator needs no rewind."""
    drafts = layout.pad_drafts(draft_token_ids).tolist()
    is_greedy = [False] * layout.num_rows if greedy is None else greedy.tolist()
    emitted: list[list[int]] = [[] for _ in range(layout.num_rows)]
    alive = list(range(layout.num_rows))
    for i in range(layout.max_k + 1):
        rows = [layout.target_starts[r] + i for r in alive]
        probs = target_probs[rows]  # (n, V)
        random = [j for j, r in enumerate(alive) if not is_greedy[r]]
        tokens = probs.argmax(dim=-1) if len(random) < len(alive) else None
        if random:
            picked = probs if len(random) == len(alive) else probs[random]
            seeded = {
                n: generators[alive[j]] for n, j in enumerate(random) if alive[j] in generators
            }
            noise = _noise(tuple(picked.shape), picked, {n: (n, n + 1) for n in seeded}, seeded)
            sampled = exponential_race(picked, noise)
            if tokens is None:
                tokens = sampled
            else:
                tokens[random] = sampled
        assert tokens is not None
        still = []
        for r, token in zip(alive, tokens.tolist()):
            emitted[r].append(token)
            if i < layout.num_draft_tokens[r] and token == drafts[r][i]:
                still.append(r)
        alive = still
        if not alive:
            break
    width = layout.max_k + 1
    padded = [row + [PLACEHOLDER_TOKEN_ID] * (width - len(row)) for row in emitted]
    device = target_probs.device
    token_ids = torch.tensor(padded, dtype=torch.int64).reshape(-1, width).to(device)
    num_accepted = torch.tensor([len(row) - 1 for row in emitted], dtype=torch.int64)
    return VerifyOutput(token_ids, num_accepted.to(device))


def _sample_with_draft_probs(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    layout: DraftLayout,
    generators: Mapping[int, torch.Generator],
) -> VerifyOutput:
    """Leviathan et al.'s rejection sampling for every row (greedy rows are replaced later)."""
    drafts = draft_token_ids.long()
    draft_segments = {
        r: (start, start + k)
        for r, (start, k) in enumerate(zip(layout.draft_starts, layout.num_draft_tokens))
    }
    p_rows = target_probs.index_select(0, layout.draft_target_rows).float()  # (D, V)
    q_rows = draft_probs.float()
    p_x = p_rows.gather(1, drafts.unsqueeze(1)).squeeze(1)  # (D,)
    q_x = q_rows.gather(1, drafts.unsqueeze(1)).squeeze(1)
    u = _noise((drafts.shape[0],), p_x, draft_segments, generators)
    # P(u * q(x) < p(x)) = min(1, p(x) / q(x)); p(x) = 0 is never accepted.
    accepted_flat = u * q_x < p_x
    residual = (p_rows - q_rows).clamp_(min=0.0)  # the race needs no normalization
    noise = _noise(tuple(residual.shape), residual, draft_segments, generators)
    recovered_flat = exponential_race(residual, noise)  # (D,)

    bonus_probs = target_probs.index_select(0, layout.bonus_rows).float()  # (R, V)
    bonus_segments = {r: (r, r + 1) for r in range(layout.num_rows)}
    noise = _noise(tuple(bonus_probs.shape), bonus_probs, bonus_segments, generators)
    bonus = exponential_race(bonus_probs, noise)  # (R,)
    if layout.max_k == 0:
        return VerifyOutput(bonus.unsqueeze(1), torch.zeros_like(bonus))

    accepted = accepted_flat[layout.draft_index] & layout.draft_valid  # (R, max_k)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    # Column a_r: the residual sample where draft a_r was rejected, the bonus after all k_r.
    at_rejection = recovered_flat[layout.draft_index].gather(
        1, num_accepted.clamp(max=layout.max_k - 1).unsqueeze(1)
    )
    last = torch.where(num_accepted < layout.num_drafts, at_rejection.squeeze(1), bonus)
    tokens = torch.cat([layout.pad_drafts(drafts), bonus.unsqueeze(1)], dim=1)
    tokens = tokens.scatter(1, num_accepted.unsqueeze(1), last.unsqueeze(1))
    return VerifyOutput(_emit(tokens, num_accepted), num_accepted)


def snapshot_generators(generators: Mapping[int, torch.Generator]) -> dict[int, torch.Tensor]:
    """Each generator's state, taken before a sampler draws a row's k_r + 1 positions."""
    return {row: g.get_state() for row, g in generators.items()}


def rewind_generators(
    generators: Mapping[int, torch.Generator],
    snapshots: Mapping[int, torch.Tensor],
    num_accepted: Sequence[int],
    draw_numel: int,
) -> None:
    """Leave each seeded row's generator as after a_r + 1 of its draws from its snapshot, one
    (draw_numel,) float32 uniform row per emitted token, as plain decoding would have drawn
    them (the plain sampler draws a vocabulary-sized row per token: draw_numel = V).

    For callers that sample the T target rows with the plain sampler (expand_generators), then
    accept_greedy or accept_prefixes: a seeded row drew k_r + 1 rows but kept a_r + 1 tokens."""
    for row, g in generators.items():
        g.set_state(snapshots[row])
        scratch = torch.empty(draw_numel, dtype=torch.float32, device=g.device)
        for _ in range(num_accepted[row] + 1):
            scratch.uniform_(generator=g)
