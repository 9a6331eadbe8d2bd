"""ProposalBackoff: per request, stop proposing for a while after drafts that all failed.

A verification fails when it rejects every draft token it was given. After f >= GRACE failures
in a row a request proposes nothing for the next min(2^(f - GRACE + 1) - 1, max_steps) steps
(1, 3, 7, 15, ...); one accepted draft token resets it. So text the proposer cannot predict
(random tokens) soon costs one skipped step check per request and step, while a request whose
drafts start landing again is back to full speculation after its current pause. A single
failure does not pause (GRACE = 2): where a model rewrites a word of the text it copies, the
next drafts usually land again (on the copy workload at k = 5, 2-grams, pausing after one
failure gave 1.80x and 1.88x of plain decoding where never pausing gave 1.84x and 1.95x, in
two alternating runs; GRACE = 2 gave 1.94x). Nothing here knows about tokens: any proposer
(n-gram, draft model) can hold one.
"""

from __future__ import annotations

from dataclasses import dataclass

GRACE = 2  # failed verifications in a row before the first pause


@dataclass
class _State:
    failures: int = 0  # verifications in a row that accepted no draft token
    skip_left: int = 0  # steps still to skip before the next proposal


class ProposalBackoff:
    """Which requests may propose this step. A step is one `allow` call for the request."""

    def __init__(self, max_steps: int) -> None:
        """max_steps: the longest pause, in steps; 0 never pauses."""
        assert max_steps >= 0
        self.max_steps = max_steps
        self._states: dict[str, _State] = {}  # only requests with a failure since their last hit

    def allow(self, request_id: str) -> bool:
        """Whether the request may propose in this step; a paused request's pause shortens by
        one step."""
        state = self._states.get(request_id)
        if state is None or state.skip_left == 0:
            return True
        state.skip_left -= 1
        return False

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """One verification's outcome: num_accepted of the num_proposed draft tokens held
        (0 <= num_accepted <= num_proposed; a step without drafts records nothing)."""
        assert 0 <= num_accepted <= num_proposed
        if num_proposed == 0 or self.max_steps == 0:
            return
        if num_accepted > 0:
            self._states.pop(request_id, None)
            return
        state = self._states.setdefault(request_id, _State())
        state.failures = min(state.failures + 1, GRACE - 1 + self.max_steps.bit_length())
        state.skip_left = min(2 ** (state.failures - GRACE + 1) - 1, self.max_steps)

    def remove(self, request_id: str) -> None:
        """Forget a finished or aborted request."""
        self._states.pop(request_id, None)

    def skip_left(self, request_id: str) -> int:
        """Steps the request will still skip (0: it proposes at its next step)."""
        state = self._states.get(request_id)
        return 0 if state is None else state.skip_left
