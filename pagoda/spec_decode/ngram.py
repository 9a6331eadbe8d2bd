"""NgramProposer: prompt-lookup drafts from a request's own tokens (vLLM's "ngram" method).

The draft for tokens t[0:T] continues the longest suffix n-gram t[T-n:T], n in
[prompt_lookup_min, prompt_lookup_max], that also occurs earlier, at some start s < T - n
(overlapping the suffix is allowed). Among the occurrences of that longest n-gram the earliest
one is used, as vLLM's NgramProposer does; the draft is the up to k tokens after it:

    t:  a b c d x y b c d      (T = 9, n = 3: suffix "b c d")
          ^^^^^ s = 1          draft = t[s + n : s + n + k] = "x y b ..." (stops at T)

Matching runs over a numpy copy of each request's tokens that grows as the request does, so a
step costs one vectorized scan for the last token plus one pass per n-gram length over the
surviving candidates, not a pass in Python over the context.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagoda.spec_decode.backoff import ProposalBackoff
from pagoda.speculative_config import DEFAULT_MAX_BACKOFF_STEPS, SpeculativeConfig

TokenIds = Sequence[int] | np.ndarray


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The up to k tokens that follow the earliest earlier occurrence of the longest suffix
    n-gram of `tokens` (1-D, integers), min_n <= n <= max_n; empty when there is none.
    The result is a view into `tokens`."""
    total = tokens.shape[0]
    empty = tokens[:0]
    if k <= 0 or total <= min_n:
        return empty
    # ends: candidate last positions j of an earlier occurrence; each is followed by t[j + 1].
    # Invariant at the top of the loop: every j in ends has t[j-n+1 : j+1] == t[T-n : T].
    ends = np.flatnonzero(tokens[: total - 1] == tokens[total - 1])
    best_end, n = -1, 1
    while ends.size:
        if n >= min_n:
            best_end = int(ends[0])  # ascending: the earliest occurrence of this length
        if n == max_n or n == total - 1:
            break
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[total - 1 - n]]
        n += 1
    if best_end < 0:
        return empty
    return tokens[best_end + 1 : best_end + 1 + k]


class _Context:
    """One request's tokens as a numpy array that grows with the request (amortized doubling):
    each step copies only the tokens that are new since the last one."""

    def __init__(self) -> None:
        self.buffer = np.empty(0, dtype=np.int64)
        self.length = 0

    def update(self, token_ids: Sequence[int]) -> np.ndarray:
        """The request's tokens now, `token_ids`, which extend those of the previous call
        (token ids only grow); anything else is copied again from the start."""
        size, n = len(token_ids), self.length
        if size < n or (n and token_ids[n - 1] != self.buffer[n - 1]):
            n = 0
        if size > self.buffer.shape[0]:
            grown = np.empty(max(size, 2 * self.buffer.shape[0], 64), dtype=np.int64)
            grown[:n] = self.buffer[:n]
            self.buffer = grown
        self.buffer[n:size] = token_ids[n:size]
        self.length = size
        return self.buffer[:size]


class NgramProposer:
    """Draft tokens for a batch of requests, with per-request backoff (see backoff.py).

    Per request the proposer keeps a numpy copy of its tokens and its backoff state, keyed by
    request id: call `remove` when a request finishes or is aborted.
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        max_backoff_steps: int = DEFAULT_MAX_BACKOFF_STEPS,
    ) -> None:
        assert num_speculative_tokens >= 1 and 1 <= prompt_lookup_min <= prompt_lookup_max
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.backoff = ProposalBackoff(max_backoff_steps)
        self._contexts: dict[str, _Context] = {}

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> NgramProposer:
        assert config.method == "ngram"
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        return cls(
            config.num_speculative_tokens,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            config.max_backoff_steps,
        )

    def propose(self, requests: Sequence[tuple[str, TokenIds, int]]) -> list[list[int]]:
        """Drafts for (request id, token ids, max tokens allowed) triples, in order.

        token ids: the request's prompt and output so far (a list that only grows between calls,
        or a numpy array, used as is). A draft holds at most min(k, max tokens allowed) tokens;
        the caller sets the allowance so that the step's k + 1 tokens stay within max_tokens
        and max_model_len. A request in backoff gets [] (and counts one step of its pause).
        """
        return [self._propose_one(*request) for request in requests]

    def _propose_one(self, request_id: str, token_ids: TokenIds, allowed: int) -> list[int]:
        k = min(self.k, allowed)
        if k <= 0 or not self.backoff.allow(request_id):
            return []
        if isinstance(token_ids, np.ndarray):
            tokens = token_ids
        else:
            context = self._contexts.get(request_id)
            if context is None:
                context = self._contexts[request_id] = _Context()
            tokens = context.update(token_ids)
        return find_ngram_draft(tokens, self.min_n, self.max_n, k).tolist()

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """A verification's outcome for the request: num_accepted of num_proposed drafts held."""
        self.backoff.record(request_id, num_proposed, num_accepted)

    def remove(self, request_id: str) -> None:
        """Forget a finished or aborted request."""
        self._contexts.pop(request_id, None)
        self.backoff.remove(request_id)
