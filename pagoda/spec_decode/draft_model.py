"""DraftModelProposer: drafts from a smaller model's continuation (vLLM's "draft_model").

The draft has a paged KV cache of its own over the target's block ids (the same blocks, other
tensors: runner/draft_step.py), so it reads and writes a request's positions where the target
does. Per request the proposer knows how many leading positions of the draft's cache are valid
(`valid`): written by the draft from the request's true tokens. To propose for a request of
T tokens t[0:T] (the last just sampled by the target):

    catch up   feed t[valid:T] at positions valid..T-1 (the whole prompt the first time), in
               passes of at most max_num_batched_tokens tokens; the token the step picks
               after the last position is d1; valid = T
    decode     feed d1 at T, d2 at T+1, ... : k - 1 more one-token steps give d2..dk

Positions T..T+k-2 lie past the target's computed tokens: the scheduler allocates k lookahead
slots beyond each step's tokens for them (Scheduler num_lookahead_tokens). When the target
accepts a of the drafts, the draft's KV at T..T+min(a, k-1)-1 was computed from accepted tokens
and so is valid too (`record`). A preempted request's blocks are gone: `remove` forgets it and
it catches up from position 0. A request proposes nothing while its catch-up would feed more
than max_catch_up_ratio tokens per token it may still produce (one that decoded without the
draft while the batch was large has its whole context to feed when the batch shrinks). A
self-draft on the target's own KV cache (loading/draft.py) feeds only the last token: the
target computed every position before it. The step picks
each draft as the target samples: the argmax for greedy requests, a draw from the draft's
processed distribution q otherwise, which verification checks by rejection sampling against
the target's p (runner/draft_sampling.py, runner/speculative.py): the output is distributed
exactly as the target's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagoda.spec_decode.backoff import ProposalBackoff
from pagoda.speculative_config import SpeculativeConfig

# One draft forward: rows of (request id, tokens to feed, position of the first) -> each row's
# next token after its last fed token (the argmax, or a draw: runner/draft_sampling.py). The
# runner's DraftModelStep is one.
DraftStepFn = Callable[[list[tuple[str, list[int], int]]], list[int]]


@dataclass
class _Proposal:
    num_tokens: int  # T when proposed: the draft's cache is valid below it
    num_drafts: int


class DraftModelProposer:
    """Draft tokens for a batch of requests from a draft model, with per-request backoff."""

    def __init__(
        self,
        config: SpeculativeConfig,
        step: DraftStepFn,
        max_step_tokens: int,
        shares_target_kv: bool = False,
        max_catch_up_ratio: float | None = None,
    ) -> None:
        """step: the draft's forward (DraftStepFn). max_step_tokens: the most tokens one
        catch-up pass feeds (the engine's max_num_batched_tokens). shares_target_kv: the draft
        runs on the target's KV cache, valid below each request's last token: only that token
        is ever fed to catch up. max_catch_up_ratio: the config's, resolved for the device
        (SpeculativeConfig.catch_up_ratio); None: always catch up."""
        assert config.model is not None and max_step_tokens >= 1
        self.shares_target_kv = shares_target_kv
        self.k = config.num_speculative_tokens
        self.step = step
        self.max_step_tokens = max_step_tokens
        self.backoff = ProposalBackoff(config.max_backoff_steps)
        # a draft on the target's cache feeds one token to catch up: never worth bounding
        self.max_catch_up_ratio = None if shares_target_kv else max_catch_up_ratio
        self.valid: dict[str, int] = {}  # leading positions of the draft's cache that are valid
        self._proposals: dict[str, _Proposal] = {}
        # requests' proposals, tokens fed to catch up, and proposals passed over because the
        # catch-up would feed too many tokens (max_catch_up_ratio), in all (tests, benchmarks)
        self.num_proposals = 0
        self.num_catch_up_tokens = 0
        self.num_catch_ups_declined = 0

    def propose(self, requests: Sequence[tuple[str, Sequence[int], int]]) -> list[list[int]]:
        """Drafts for (request id, token ids, max tokens allowed) triples, in order (the
        NgramProposer contract): at most min(k, allowed) tokens each, [] in backoff."""
        limits = {}
        for rid, tokens, allowed in requests:
            limit = min(self.k, allowed)
            if limit <= 0 or len(tokens) == 0 or not self._worth_catching_up(rid, tokens, allowed):
                continue
            if self.backoff.allow(rid):
                limits[rid] = limit
        if not limits:
            return [[] for _ in requests]
        drafts = self._catch_up([(rid, tokens) for rid, tokens, _ in requests if rid in limits])
        for j in range(1, max(limits.values())):
            rows = [
                (rid, [d[-1]], self.valid[rid] + j - 1)
                for rid, d in drafts.items()
                if len(d) < limits[rid]
            ]
            for (rid, _, _), token in zip(rows, self.step(rows)):
                drafts[rid].append(token)
        for rid, d in drafts.items():
            self._proposals[rid] = _Proposal(self.valid[rid], len(d))
        self.num_proposals += len(drafts)
        return [drafts.get(rid, []) for rid, _, _ in requests]

    def _worth_catching_up(self, rid: str, tokens: Sequence[int], allowed: int) -> bool:
        """Whether the tokens the draft would feed to catch up are at most max_catch_up_ratio
        times the tokens the request may still produce (allowed drafts plus the target's)."""
        if self.max_catch_up_ratio is None:
            return True
        to_feed = len(tokens) - self.valid.get(rid, 0)
        if to_feed <= self.max_catch_up_ratio * (allowed + 1):
            return True
        self.num_catch_ups_declined += 1
        return False

    def _catch_up(self, requests: list[tuple[str, Sequence[int]]]) -> dict[str, list[int]]:
        """Feed each request's tokens from its first invalid position to its last, in passes
        of at most max_step_tokens tokens; returns each request's first draft token."""
        pending: dict[str, tuple[Sequence[int], int]] = {}  # id -> (tokens, next position)
        for rid, tokens in requests:
            valid = len(tokens) - 1 if self.shares_target_kv else self.valid.get(rid, 0)
            pending[rid] = (tokens, min(valid, len(tokens) - 1))
        first: dict[str, list[int]] = {}
        while pending:
            rows: list[tuple[str, list[int], int]] = []
            room = self.max_step_tokens
            for rid, (tokens, start) in pending.items():
                if room == 0:
                    break
                chunk = list(tokens[start : start + room])
                rows.append((rid, chunk, start))
                room -= len(chunk)
            for (rid, chunk, start), token in zip(rows, self.step(rows)):
                tokens, _ = pending[rid]
                self.num_catch_up_tokens += len(chunk)
                if start + len(chunk) == len(tokens):
                    del pending[rid]
                    first[rid] = [token]
                    self.valid[rid] = len(tokens)
                else:
                    pending[rid] = (tokens, start + len(chunk))
        return {rid: first[rid] for rid, _ in requests}

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """A verification's outcome: num_accepted of the num_proposed drafts (the scheduler may
        have cut the proposal) held. The draft's KV of accepted drafts it fed stays valid."""
        self.backoff.record(request_id, num_proposed, num_accepted)
        proposal = self._proposals.pop(request_id, None)
        if proposal is not None and request_id in self.valid:
            fed = proposal.num_drafts - 1  # the last draft was sampled, never fed
            self.valid[request_id] = proposal.num_tokens + min(num_accepted, fed)

    def remove(self, request_id: str) -> None:
        """Forget a finished, aborted or preempted request (its blocks, and the draft's KV in
        them, are gone)."""
        self.valid.pop(request_id, None)
        self._proposals.pop(request_id, None)
        self.backoff.remove(request_id)
