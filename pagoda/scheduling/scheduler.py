"""Iteration-level scheduler: CPU bookkeeping over integers that emits plain data.

There is no prefill or decode mode. Every request's `num_computed_tokens` catches up with its
`num_tokens_with_placeholders`; each step the token budget caps how many tokens a request gets
(that cap is all chunked prefill is). Running requests are served first, then waiting ones by
policy. When blocks run out, the running request that sorts last in policy order is preempted
(fcfs: the latest arrival, whatever its priority; priority: the lowest priority, then the
latest arrival): its blocks are freed and it is recomputed later.

schedule() counts the token a sampling step will produce as an output placeholder; update()
turns it into the sampled token (or tokens: see below). With async scheduling (EngineCore) the next schedule() runs
before the previous step's update(): a request then decodes from a placeholder input, and
update() matches outputs to Request objects, since an id may finish and be reused meanwhile.

Speculative decoding is no mode of its own: a decoding request that holds proposed tokens
(`spec_token_ids`, from the runner's last output) asks for 1 + k tokens under the same budget
(drafts are cut first when the budget is short). The runner verifies them; update() keeps the
accepted drafts and the target's token after them, and rolls num_computed_tokens back over the
rejected ones, whose KV slots the next steps overwrite (their blocks stay the request's; the
prefix cache only ever publishes blocks of known tokens below num_computed_tokens).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from pagoda.config import SchedulerConfig
from pagoda.scheduling.block_pool import KVCacheBlock
from pagoda.scheduling.explain import Explainer
from pagoda.scheduling.kv_cache_manager import KVCacheManager
from pagoda.scheduling.messages import (
    PLACEHOLDER_TOKEN_ID,
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from pagoda.scheduling.request import Request, RequestStatus


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        num_lookahead_tokens: int = 0,
        max_loras: int = 0,
    ) -> None:
        """num_lookahead_tokens: KV slots each step allocates past a sampling request's tokens
        (a draft model writes its proposals' KV there before they are scheduled); max_loras:
        distinct LoRA adapters the running requests may use (the runner's slots)."""
        self.max_loras = max_loras
        self.config = scheduler_config
        self.num_lookahead_tokens = num_lookahead_tokens
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # kept sorted: next to admit first
        self.running: list[Request] = []  # admission order
        self.finished_ids: list[str] = []
        self.num_preemptions = 0
        self.step_id = 0
        self.last_num_scheduled_tokens = 0
        # The Request of each entry of a step's `scheduled`, until update() matches outputs to them.
        self.in_flight: dict[int, list[Request]] = {}
        # The block ids each request's row in the runner holds (the list last sent: block id
        # lists are replaced, never mutated). A request missing here is sent whole.
        self.runner_blocks: dict[str, list[int]] = {}
        # Speculative decoding totals (SchedulerStats): requests' verifications with drafts,
        # draft tokens, accepted drafts, and accepted drafts by position.
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted = 0
        self.spec_accepted_per_position: list[int] = []
        self.explainer = Explainer(  # scheduling/explain.py
            scheduler_config.max_explained_requests, scheduler_config.policy == "priority"
        )

    # ---- queues -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a validated request and its n > 1 siblings (which wait for the leader)."""
        self.requests[request.request_id] = request
        self._enqueue(request)
        for r in (request, *request.siblings):
            self.explainer.arrived(r, self.step_id + 1)
        for sibling in request.siblings:
            sibling.status = RequestStatus.WAITING_FOR_FORK
            self.requests[sibling.request_id] = sibling

    def _enqueue(self, request: Request) -> None:
        """Insert into the waiting queue in policy order."""
        key = self._policy_key(request)
        i = len(self.waiting)
        while i > 0 and self._policy_key(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, request)

    def _policy_key(self, request: Request) -> tuple[float, ...]:
        """Lower is admitted first and preempted last. fcfs ignores priority: arrival only.
        Preempted requests go back in front of everything that arrived after them."""
        if self.config.policy == "priority":
            return (request.priority, request.arrival_time)
        return (request.arrival_time,)

    def _preemption_victim(self) -> Request:
        """The running request that sorts last in policy order; among equals (n > 1 samples
        share an arrival time) the one admitted last."""
        return max(reversed(self.running), key=self._policy_key)

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus, all_samples: bool = True
    ) -> list[Request]:
        """Finish (e.g. abort) requests in any state; their blocks are freed at once.

        With all_samples, an id also names every n > 1 sample of that user request.
        """
        ids = set(request_ids)
        targets = [
            r
            for r in self.requests.values()
            if r.request_id in ids or (all_samples and r.parent_id in ids)
        ]
        for r in targets:
            self._finish(r, status)
        return targets

    def _waiting_siblings(self, request: Request) -> list[Request]:
        return [s for s in request.siblings if s.status == RequestStatus.WAITING_FOR_FORK]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        self.runner_blocks.pop(request.request_id, None)
        del self.requests[request.request_id]
        self.finished_ids.append(request.request_id)
        self.explainer.finished_request(request.request_id, self.step_id, status.finish_reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.requests) - len(self.running),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted,
            spec_accepted_per_position=list(self.spec_accepted_per_position),
            running_lora_ids=sorted({r.lora_id for r in self.running} - {0}),
            waiting_lora_ids=sorted({r.lora_id for r in self.waiting} - {0}),
        )

    # ---- schedule -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Running requests first, then waiting ones in policy order (none in a step that
        preempted), within the token budget; then the step as plain data."""
        num_new: dict[str, int] = {}  # tokens scheduled per request id, in batch order
        preempted = self._schedule_running(num_new)
        blocked = "preemption" if preempted else self._schedule_waiting(num_new)
        if self.explainer.live:  # timelines are kept (--max-explained-requests > 0)
            idle = [r for r in self.running if r.request_id not in num_new]
            idle = [r for r in idle if not self._finishes_in_flight(r)]  # not waiting: done
            step = self.step_id + 1
            self.explainer.step(step, self.requests, num_new, idle, self.waiting, blocked)
        self.last_num_scheduled_tokens = sum(num_new.values())  # for snapshot.py
        return self._emit(num_new, preempted)

    def _schedule_running(self, num_new: dict[str, int]) -> list[Request]:
        """Give each running request its missing tokens, preempting in policy order when
        blocks run out; returns the preempted requests."""
        budget = self.config.max_num_batched_tokens
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self._finishes_in_flight(request):
                i += 1
                continue
            missing = request.num_tokens_with_placeholders - request.num_computed_tokens
            n = min(missing + len(self._drafts(request, missing)), budget)
            scheduled = True
            while not self.kv.allocate_slots(request, n + self._lookahead(request, n)):
                victim = self._preemption_victim()
                if self.running.index(victim) < i:  # keep i on `request` as the list shrinks
                    i -= 1
                self._preempt(victim)
                preempted.append(victim)
                self.explainer.preempted(victim.request_id, self.step_id + 1, request.request_id)
                if victim.request_id in num_new:
                    budget += num_new.pop(victim.request_id)
                if victim is request:
                    scheduled = False
                    break
            if scheduled:
                num_new[request.request_id] = n
                budget -= n
                i += 1
            # else: `request` left self.running, so index i now holds the next one.
        return preempted

    def _schedule_waiting(self, num_new: dict[str, int]) -> str | None:
        """Admit waiting requests in policy order while seats, budget and blocks last (prefix
        cache hits first advance a new request's num_computed_tokens); returns why the first
        request left waiting was not admitted (explain.WAIT_REASONS), None if none is left."""
        budget = self.config.max_num_batched_tokens - sum(num_new.values())
        # Seats: the running requests and the n > 1 siblings their prompts will fork.
        seats = len(self.running) + sum(len(self._waiting_siblings(r)) for r in self.running)
        i, lora_blocked = 0, False
        while i < len(self.waiting) and budget > 0:
            request = self.waiting[i]
            if not self._lora_fits(request):  # its adapter would be one more than max_loras
                i, lora_blocked = i + 1, True
                continue
            # A placeholder is updated before the next schedule(); a request preempted with one
            # is not admitted in the schedule() that preempted it.
            assert request.num_output_placeholders == 0, request
            need = 1 + len(self._waiting_siblings(request))
            if seats + need > self.config.max_num_seqs:
                return "max_num_seqs"
            hits: list[KVCacheBlock] = []
            num_hit_tokens = 0
            if request.num_computed_tokens == 0:
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            n = min(request.num_tokens - request.num_computed_tokens - num_hit_tokens, budget)
            lookahead = self._lookahead(request, n + num_hit_tokens)
            if not self.kv.allocate_slots(request, n + lookahead, hits):
                return "no_free_blocks"
            self.waiting.pop(i)
            block_ids = [b.block_id for b in hits]
            self.explainer.admitted(request.request_id, self.step_id + 1, num_hit_tokens, block_ids)
            request.num_computed_tokens += num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.time()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_new[request.request_id] = n
            budget -= n
            seats += need
        return "max_loras" if lora_blocked else "token_budget" if self.waiting else None

    def _lora_fits(self, request: Request) -> bool:
        """Admitting it keeps at most max_loras distinct adapters among the running requests."""
        running = {r.lora_id for r in self.running} - {0}
        return request.lora_id in running or request.lora_id == 0 or len(running) < self.max_loras

    def _lookahead(self, request: Request, n: int) -> int:
        """The lookahead slots of a request given n tokens now: only a step that samples it
        proposes after, and no slot lies past max_model_len."""
        end = request.num_computed_tokens + n
        if not self.num_lookahead_tokens or end < request.num_tokens_with_placeholders:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - end))

    def _drafts(self, request: Request, missing: int) -> list[int]:
        """The proposed tokens a request may verify now: only when its one missing token is its
        last sampled one (decoding), and never past max_tokens or max_model_len (the target's
        token after the drafts counts too). A request with a grammar verifies them under its
        masks at every position (engine/grammar.py)."""
        if missing != 1 or not request.spec_token_ids:
            return []
        room = min(
            request.max_tokens - request.num_output_tokens - request.num_output_placeholders,
            self.max_model_len - request.num_tokens_with_placeholders,
        )
        return request.spec_token_ids[: max(room - 1, 0)]

    def _emit(self, num_new: dict[str, int], preempted: list[Request]) -> SchedulerOutput:
        """The step as plain data; advances num_computed_tokens and counts placeholders."""
        requests = [self.requests[rid] for rid in num_new]
        batch = [self._scheduled(r, num_new[r.request_id]) for r in requests]
        for request, s in zip(requests, batch):
            request.num_computed_tokens += len(s.token_ids)
            request.spec_token_ids = []
            if s.sample_ids:
                request.num_output_placeholders += 1
        finished, self.finished_ids = self.finished_ids, []
        new_requests, cached_requests = self._deltas(requests)
        self.step_id += 1
        self.in_flight[self.step_id] = requests
        return SchedulerOutput(
            step_id=self.step_id,
            scheduled=batch,
            new_requests=new_requests,
            cached_requests=cached_requests,
            block_copies=self.kv.take_pending_copies(),
            finished_request_ids=finished,
            preempted_request_ids=[r.request_id for r in preempted],
        )

    def _deltas(
        self, requests: list[Request]
    ) -> tuple[list[NewRequestData], list[CachedRequestData]]:
        """What the runner lacks of this step's requests: whole requests it does not hold, and
        the changed part of the block tables of those it does."""
        new: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        for request in requests:
            rid = request.request_id
            block_ids = self.kv.get_block_ids(rid)
            held = self.runner_blocks.get(rid)
            if held is None:
                new.append(
                    NewRequestData(
                        request_id=rid,
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=block_ids,
                        sample_index=request.sample_index,
                        lora_id=request.lora_id,
                    )
                )
            elif block_ids is not held:
                start = _first_difference(held, block_ids)
                if start < max(len(held), len(block_ids)):
                    cached.append(CachedRequestData(rid, start, block_ids[start:]))
            self.runner_blocks[rid] = block_ids
        return new, cached

    def _finishes_in_flight(self, request: Request) -> bool:
        """Whether a step not yet updated samples the request's last token (max_tokens or
        max_model_len reached): another step would compute a token nobody reads."""
        placeholders = request.num_output_placeholders
        return placeholders > 0 and self._length_capped(request, placeholders)

    def _length_capped(self, request: Request, num_pending: int = 0) -> bool:
        """Whether the request is at max_tokens or max_model_len, counting num_pending more
        outputs than it knows."""
        return (
            request.num_output_tokens + num_pending >= request.max_tokens
            or request.num_tokens + num_pending >= self.max_model_len
        )

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self.runner_blocks.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)

    def _scheduled(self, request: Request, n: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        missing = request.num_tokens_with_placeholders - start
        drafts = self._drafts(request, missing)[: max(n - missing, 0)]
        n -= len(drafts)
        num_outputs = request.num_output_tokens + request.num_output_placeholders
        sample_ids: list[str] = []
        sample_indices: list[int] = []
        if start + n == request.num_tokens_with_placeholders:
            sample_ids.append(request.request_id)
            sample_indices.append(request.sample_index)
            # Siblings sample their first token from the prompt's last row (the leader's first
            # sample), and fork when that step is updated.
            if num_outputs == 0:
                for s in self._waiting_siblings(request):
                    sample_ids.append(s.request_id)
                    sample_indices.append(s.sample_index)
        # Row p's logits score prompt token p + 1, so the last prompt position has no target;
        # positions scored before a preemption are not scored again on recompute.
        plp_offset = num_plp = 0
        if request.sampling_params.prompt_logprobs is not None:
            lo = max(start, request.num_prompt_logprobs_done)
            hi = min(start + n, request.num_prompt_tokens - 1)
            if hi > lo:
                plp_offset, num_plp = lo - start, hi - lo
                request.num_prompt_logprobs_done = hi
        token_ids = request.all_token_ids[start : start + n]
        token_ids += [PLACEHOLDER_TOKEN_ID] * (n - len(token_ids))
        token_ids += drafts
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            start=start,
            num_output_tokens=num_outputs,
            sample_ids=sample_ids,
            sample_indices=sample_indices,
            prompt_logprob_offset=plp_offset,
            num_prompt_logprob_tokens=num_plp,
            num_draft_tokens=len(drafts),
        )

    # ---- update -------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, runner: RunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for s, request in zip(out.scheduled, self.in_flight.pop(out.step_id)):
            if request.is_finished:  # finished (e.g. aborted) while the step ran
                continue
            prompt_lps = runner.prompt_logprobs.get(s.request_id, [])
            if s.num_draft_tokens:
                self._verified(request, s.num_draft_tokens, runner.sampled_token_ids[s.request_id])
            samples = [request]
            if len(s.sample_ids) > 1:
                siblings = {x.request_id: x for x in request.siblings}
                for rid in s.sample_ids[1:]:
                    if not siblings[rid].is_finished:
                        self._fork(request, siblings[rid], s.start + len(s.token_ids))
                        samples.append(siblings[rid])
            self.kv.cache_blocks(request)
            if not s.sample_ids:
                if prompt_lps:
                    outputs.append(request.output([], [], prompt_lps))
                continue
            request.num_output_placeholders -= 1
            if s.request_id in runner.pooled:  # --runner pooling: its vector, and no token
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                outputs.append(request.output([], [], [], runner.pooled[s.request_id]))
                continue
            for r in samples:
                tokens = self._append_outputs(r, runner.sampled_token_ids[r.request_id])
                lps = runner.logprobs.get(r.request_id, [])[: len(tokens)]
                outputs.append(r.output(tokens, lps, prompt_lps if r is request else []))
            if s.num_draft_tokens and not request.is_finished:
                self.kv.cache_blocks(request)  # blocks completed by accepted drafts
        if runner.draft_token_ids:
            for request in self.running:
                request.spec_token_ids = runner.draft_token_ids.get(request.request_id, [])
        return outputs

    def _append_outputs(self, request: Request, tokens: list[int]) -> list[int]:
        """Append new tokens up to the first that finishes the request; returns those kept."""
        for i, token in enumerate(tokens):
            request.append_output_token(token)
            status = self._stop_status(request, token)
            if status is not None:
                self._finish(request, status)
                return tokens[: i + 1]
        return tokens

    def _verified(self, request: Request, num_drafts: int, tokens: list[int]) -> None:
        """After a step that verified num_drafts proposed tokens and returned `tokens` (the
        accepted drafts, then the target's own): roll num_computed_tokens back over the
        rejected drafts, whose KV is not valid, and count the outcome."""
        num_accepted = len(tokens) - 1
        assert 0 <= num_accepted <= num_drafts, (num_accepted, num_drafts)
        request.num_computed_tokens -= num_drafts - num_accepted
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted += num_accepted
        self.explainer.verified(request.request_id, num_drafts, num_accepted)
        per_position = self.spec_accepted_per_position
        per_position.extend([0] * (num_drafts - len(per_position)))
        for i in range(num_accepted):
            per_position[i] += 1

    def _fork(self, leader: Request, sibling: Request, num_prompt_computed: int) -> None:
        """Start an n > 1 sample on the leader's blocks of its computed prompt. A leader
        preempted meanwhile (async scheduling) has no blocks: the sample waits to recompute."""
        sibling.num_cached_tokens = leader.num_cached_tokens
        sibling.first_scheduled_time = leader.first_scheduled_time
        if leader.status == RequestStatus.PREEMPTED:
            sibling.status = RequestStatus.PREEMPTED
            self._enqueue(sibling)
            return
        self.kv.fork(leader, sibling, num_prompt_computed)
        sibling.num_computed_tokens = num_prompt_computed
        sibling.status = RequestStatus.RUNNING
        self.running.append(sibling)

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if self._length_capped(request):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None


def _first_difference(a: list[int], b: list[int]) -> int:
    """The first index at which a and b differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
