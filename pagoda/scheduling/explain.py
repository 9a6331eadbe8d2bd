"""Per-request timelines, for `explain`: why a request waited at each step, what it found in
the prefix cache, its prefill chunks, decode steps and preemptions, the speculative drafts its
decode steps verified and accepted, and how it finished.

The scheduler reports arrivals, admissions, preemptions, finishes and every step it builds
(scheduling/scheduler.py); this keeps one RequestTimeline per live request and the last `keep`
finished ones. Steps are the scheduler's step ids. Consecutive steps a request waited for the
same reason, or decoded, are one entry with a count.

Why a request waited in a step (`WAIT_REASONS`): the first waiting request that was not admitted
gives the step's reason (the token budget was spent, no free KV blocks, max_num_seqs requests
already run, the step preempted, which admits nobody, or its LoRA adapter would be one more
than max_loras among the running requests); requests behind it wait for the same reason, or,
under the priority policy, because a request of higher priority is ahead of them. A running
request that got no tokens waited for the token budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

WAIT_REASONS = (
    "token_budget",
    "no_free_blocks",
    "max_num_seqs",
    "preemption",
    "lower_priority",
    "max_loras",
)


class _Request(Protocol):
    request_id: str
    arrival_time: float
    priority: int
    num_computed_tokens: int

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens_with_placeholders(self) -> int: ...


@dataclass
class TimelineEntry:
    event: str  # arrived | waited | admitted | prefill | decode | preempted | finished
    step: int  # the first step of the entry
    num_steps: int = 1
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"event": self.event, "step": self.step, "num_steps": self.num_steps, **self.detail}


@dataclass
class RequestTimeline:
    request_id: str
    arrival_time: float
    arrival_step: int
    entries: list[TimelineEntry] = field(default_factory=list)
    steps_waited: dict[str, int] = field(default_factory=dict)
    num_cached_prompt_tokens: int = 0
    cached_block_ids: list[int] = field(default_factory=list)
    num_prefill_chunks: int = 0
    num_decode_steps: int = 0
    num_preemptions: int = 0
    num_steps_scheduled: int = 0
    num_verifications: int = 0  # decode steps that verified speculative drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    finish_reason: str | None = None
    finish_step: int | None = None

    def add(self, event: str, step: int, detail: dict[str, Any] | None = None) -> None:
        self.entries.append(TimelineEntry(event, step, 1, detail or {}))

    def repeat(self, event: str, step: int, reason: str | None = None) -> None:
        """Extend the last entry when it is this event (with this reason) in the step before,
        else add one: the per-step path, which builds no entry while nothing changes."""
        last = self.entries[-1] if self.entries else None
        if (
            last is not None
            and last.event == event
            and last.step + last.num_steps == step
            and last.detail.get("reason") == reason
        ):
            last.num_steps += 1
        else:
            self.add(event, step, None if reason is None else {"reason": reason})

    def to_dict(self, current_step: int) -> dict[str, Any]:
        last = self.finish_step if self.finish_step is not None else current_step
        span = max(last - self.arrival_step + 1, 1)
        return {
            "request_id": self.request_id,
            "arrival_time": self.arrival_time,
            "arrival_step": self.arrival_step,
            "finish_step": self.finish_step,
            "finish_reason": self.finish_reason,
            "steps_waited": dict(self.steps_waited),
            "num_cached_prompt_tokens": self.num_cached_prompt_tokens,
            "cached_block_ids": list(self.cached_block_ids),
            "num_prefill_chunks": self.num_prefill_chunks,
            "num_decode_steps": self.num_decode_steps,
            "num_preemptions": self.num_preemptions,
            "num_steps_scheduled": self.num_steps_scheduled,
            "share_of_steps": round(self.num_steps_scheduled / span, 4),
            "speculative": self._speculative(),
            "timeline": [e.to_dict() for e in self.entries],
        }

    def _speculative(self) -> dict[str, Any] | None:
        """Drafts verified and accepted; None when no step of the request verified any."""
        if not self.num_verifications:
            return None
        return {
            "num_verifications": self.num_verifications,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.num_accepted_tokens / max(self.num_draft_tokens, 1), 4),
        }


class Explainer:
    """The timelines of live requests and of the last `keep` finished ones."""

    def __init__(self, keep: int, priority_policy: bool = False) -> None:
        self.keep = keep
        self.priority_policy = priority_policy
        self.live: dict[str, RequestTimeline] = {}
        self.finished: OrderedDict[str, RequestTimeline] = OrderedDict()

    def arrived(self, request: _Request, step: int) -> None:
        if self.keep == 0:  # nothing is kept: record nothing
            return
        t = RequestTimeline(request.request_id, request.arrival_time, step)
        t.add("arrived", step, {"num_prompt_tokens": request.num_prompt_tokens})
        self.live[request.request_id] = t

    def admitted(self, request_id: str, step: int, num_cached: int, block_ids: list[int]) -> None:
        t = self.live.get(request_id)
        if t is None:
            return
        if t.num_preemptions == 0:  # the first admission's cache hits are the prompt's
            t.num_cached_prompt_tokens, t.cached_block_ids = num_cached, list(block_ids)
        t.add("admitted", step, {"num_cached_tokens": num_cached, "cached_block_ids": block_ids})

    def preempted(self, request_id: str, step: int, for_request_id: str) -> None:
        t = self.live.get(request_id)
        if t is None:
            return
        t.num_preemptions += 1
        # the blocks were needed by `for_request_id` (itself when it had to give its own up)
        t.add("preempted", step, {"reason": "no_free_blocks", "for_request_id": for_request_id})

    def scheduled(self, request_id: str, step: int, num_tokens: int, decode: bool) -> None:
        t = self.live.get(request_id)
        if t is None:
            return
        t.num_steps_scheduled += 1
        if decode:
            t.num_decode_steps += 1
            t.repeat("decode", step)
        else:
            t.num_prefill_chunks += 1
            t.add("prefill", step, {"num_tokens": num_tokens})

    def verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        t = self.live.get(request_id)
        if t is None:
            return
        t.num_verifications += 1
        t.num_draft_tokens += num_drafts
        t.num_accepted_tokens += num_accepted

    def waited(self, request_id: str, step: int, reason: str) -> None:
        t = self.live.get(request_id)
        if t is None:
            return
        t.steps_waited[reason] = t.steps_waited.get(reason, 0) + 1
        t.repeat("waited", step, reason)

    def step(
        self,
        step: int,
        requests: Mapping[str, _Request],
        num_new: dict[str, int],
        idle_running: Sequence[_Request],
        waiting: Sequence[_Request],
        blocked: str | None,
    ) -> None:
        """One step as scheduled (before it advances num_computed_tokens): the tokens each
        request got (a decode step when only its last token was missing), the running requests
        the token budget left out, and why each request still waiting waits (`blocked`: why the
        first of them was not admitted)."""
        for rid, n in num_new.items():
            r = requests[rid]
            self.scheduled(
                rid, step, n, r.num_tokens_with_placeholders - r.num_computed_tokens == 1
            )
        for r in idle_running:
            self.waited(r.request_id, step, "token_budget")
        if not waiting or blocked is None:
            return
        head = waiting[0].priority
        for i, r in enumerate(waiting):
            lower = self.priority_policy and i > 0 and r.priority > head
            self.waited(r.request_id, step, "lower_priority" if lower else blocked)

    def finished_request(self, request_id: str, step: int, reason: str | None) -> None:
        t = self.live.pop(request_id, None)
        if t is None:
            return
        t.finish_reason, t.finish_step = reason, step
        t.add("finished", step, {"finish_reason": reason})
        self.finished[request_id] = t
        while len(self.finished) > self.keep:
            self.finished.popitem(last=False)

    def explain(self, request_id: str, current_step: int) -> dict[str, Any] | None:
        """A live or recently finished request's timeline; None when it is unknown (never
        seen, or finished longer ago than the last `keep`)."""
        t = self.live.get(request_id) or self.finished.get(request_id)
        return None if t is None else t.to_dict(current_step)
