"""Scheduler bookkeeping with a fake model runner: queues, token budget, chunked prefill,
preemption, stop conditions, aborts, n > 1 forks and prefix-cache hits.

Each step is schedule() then update() with a RunnerOutput built by hand: one sampled token
per id in each ScheduledRequest's sample_ids.
"""

from collections.abc import Callable

import pytest

from pagoda.config import SchedulerConfig
from pagoda.runner.input_batch import InputBatch, RequestRow
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.block_pool import BlockPool
from pagoda.scheduling.kv_cache_manager import KVCacheManager
from pagoda.scheduling.messages import (
    PLACEHOLDER_TOKEN_ID,
    EngineCoreOutput,
    EngineRequest,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    sample_request_id,
)
from pagoda.scheduling.request import Request, RequestStatus
from pagoda.scheduling.scheduler import Scheduler

BS = 4
EOS = 2
TOK = 7  # a sampled token that stops nothing


class RunnerSideScheduler(Scheduler):
    """Applies each output to a runner-side InputBatch, as the model runner does, so a test
    reads a step's block tables as the runner holds them after that step's deltas."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.runner_batch = InputBatch(vocab_size=1 << 20)

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        self.runner_batch.apply(out)
        return out


def held(sched: Scheduler, s: ScheduledRequest) -> RequestRow:
    """The runner's row of a scheduled request, after the step's deltas."""
    assert isinstance(sched, RunnerSideScheduler)
    return sched.runner_batch.rows[s.request_id]


def make_scheduler(
    *,
    num_blocks: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    policy: str = "fcfs",
    enable_caching: bool = True,
    max_model_len: int = 1024,
) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, enable_caching), BS)
    return RunnerSideScheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            policy=policy,
        ),
        kv,
        max_model_len,
    )


def prompt(k: int, length: int) -> list[int]:
    """A prompt that shares no block with prompt(j, ...) for j != k."""
    return [1000 * k + i for i in range(length)]


def make_request(
    rid: str,
    prompt_token_ids: list[int],
    *,
    arrival: float,
    priority: int = 0,
    max_tokens: int = 16,
    n: int = 1,
    **params,
) -> Request:
    """A request and its n - 1 siblings, built as EngineCore.add_request builds them."""
    sp = SamplingParams(n=n, max_tokens=max_tokens, **params)
    reqs = [
        Request(
            sample_request_id(rid, i),
            list(prompt_token_ids),
            sp,
            max_tokens=max_tokens,
            eos_token_ids=frozenset({EOS}),
            arrival_time=arrival,
            priority=priority,
            parent_id=rid,
            sample_index=i,
        )
        for i in range(n)
    ]
    reqs[0].siblings = reqs[1:]
    return reqs[0]


def step(
    sched: Scheduler, tokens: dict[str, int] | None = None
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step; every sampling request gets tokens[rid] (default TOK)."""
    out = sched.schedule()
    tokens = tokens or {}
    sampled = {rid: [tokens.get(rid, TOK)] for s in out.scheduled for rid in s.sample_ids}
    return out, sched.update(out, RunnerOutput(sampled, logprobs={}, prompt_logprobs={}))


def num_scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: len(s.token_ids) for s in out.scheduled}


def ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def free_ids(sched: Scheduler) -> list[int]:
    return [b.block_id for b in sched.kv.pool.free_queue.values()]


def ref_cnts(sched: Scheduler) -> list[int]:
    return [b.ref_cnt for b in sched.kv.pool.blocks]


def assert_pool_all_free(sched: Scheduler) -> None:
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert ref_cnts(sched) == [0] * pool.num_blocks
    assert sched.kv.req_blocks == {}


# ---- token budget and chunked prefill ---------------------------------------------------


def test_chunked_prefill_8_8_4_samples_only_on_last_chunk():
    sched = make_scheduler(max_num_batched_tokens=8)
    p = prompt(1, 20)
    a = make_request("a", p, arrival=0, max_tokens=3)
    sched.add_request(a)

    expected = [  # (start, tokens, block ids, sample ids)
        (0, p[0:8], [0, 1], []),
        (8, p[8:16], [0, 1, 2, 3], []),
        (16, p[16:20], [0, 1, 2, 3, 4], ["a"]),
        (20, [TOK], [0, 1, 2, 3, 4, 5], ["a"]),
    ]
    for i, (start, tokens, block_ids, sample_ids) in enumerate(expected):
        out, outputs = step(sched)
        assert len(out.scheduled) == 1
        s = out.scheduled[0]
        assert (s.request_id, s.start, s.token_ids) == ("a", start, tokens)
        assert held(sched, s).block_ids == block_ids
        assert s.sample_ids == sample_ids
        assert s.sample_indices == ([0] if sample_ids else [])
        assert out.num_scheduled_tokens == len(tokens)
        assert a.num_computed_tokens == start + len(tokens)
        assert ids(sched.running) == ["a"]
        if sample_ids:
            assert [o.new_token_ids for o in outputs] == [[TOK]]
        else:
            assert outputs == []
        if i == 0:
            # Full computed blocks are published as soon as they are computed.
            assert sorted(b.block_id for b in sched.kv.pool.cached.values()) == [0, 1]
    assert a.output_token_ids == [TOK, TOK]
    assert a.num_tokens == 22


def test_running_first_then_waiting_share_the_budget():
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("a", prompt(1, 8), arrival=0))
    sched.add_request(make_request("b", prompt(2, 8), arrival=1))

    out, _ = step(sched)
    assert num_scheduled(out) == {"a": 8, "b": 2}
    assert [s.sample_ids for s in out.scheduled] == [["a"], []]

    sched.add_request(make_request("c", prompt(3, 5), arrival=2))
    out, _ = step(sched)
    assert list(num_scheduled(out).items()) == [("a", 1), ("b", 6), ("c", 3)]
    assert [s.sample_ids for s in out.scheduled] == [["a"], ["b"], []]
    assert [s.start for s in out.scheduled] == [8, 2, 0]

    out, _ = step(sched)
    assert list(num_scheduled(out).items()) == [("a", 1), ("b", 1), ("c", 2)]
    assert [s.sample_ids for s in out.scheduled] == [["a"], ["b"], ["c"]]


def test_budget_spent_on_running_leaves_waiting_alone():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("a", prompt(1, 10), arrival=0))
    sched.add_request(make_request("b", prompt(2, 4), arrival=1))
    out, _ = step(sched)
    assert num_scheduled(out) == {"a": 4}
    assert ids(sched.waiting) == ["b"]
    assert sched.requests["b"].status == RequestStatus.WAITING
    assert sched.kv.get_block_ids("b") == []


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request("a", prompt(1, 4), arrival=0, max_tokens=1))
    sched.add_request(make_request("b", prompt(2, 4), arrival=1))
    sched.add_request(make_request("c", prompt(3, 4), arrival=2))

    out, outputs = step(sched)
    assert list(num_scheduled(out)) == ["a", "b"]
    assert ids(sched.waiting) == ["c"]
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "length"), ("b", None)]
    assert ids(sched.running) == ["b"]

    out, _ = step(sched)
    assert out.finished_request_ids == ["a"]
    assert list(num_scheduled(out).items()) == [("b", 1), ("c", 4)]
    assert ids(sched.running) == ["b", "c"]
    assert sched.waiting == []


def test_fcfs_orders_by_arrival_and_ignores_priority():
    sched = make_scheduler(policy="fcfs")
    sched.add_request(make_request("r3", prompt(3, 4), arrival=3.0, priority=0))
    sched.add_request(make_request("r1", prompt(1, 4), arrival=1.0, priority=5))
    sched.add_request(make_request("r2", prompt(2, 4), arrival=2.0, priority=-5))
    assert ids(sched.waiting) == ["r1", "r2", "r3"]
    out, _ = step(sched)
    assert list(num_scheduled(out)) == ["r1", "r2", "r3"]
    assert ids(sched.running) == ["r1", "r2", "r3"]


def test_priority_policy_orders_by_priority_then_arrival():
    sched = make_scheduler(policy="priority", max_num_seqs=2)
    sched.add_request(make_request("a", prompt(1, 4), arrival=0.0, priority=1))
    sched.add_request(make_request("b", prompt(2, 4), arrival=2.0, priority=0))
    sched.add_request(make_request("c", prompt(3, 4), arrival=1.0, priority=0))
    sched.add_request(make_request("d", prompt(4, 4), arrival=3.0, priority=1))
    assert ids(sched.waiting) == ["c", "b", "a", "d"]
    out, _ = step(sched)
    assert list(num_scheduled(out)) == ["c", "b"]
    assert ids(sched.waiting) == ["a", "d"]


# ---- preemption -------------------------------------------------------------------------


def test_preemption_evicts_latest_arrival_and_it_resumes_with_prefix_hits():
    sched = make_scheduler(num_blocks=4)
    a = make_request("a", prompt(1, 7), arrival=0, max_tokens=3)
    b = make_request("b", prompt(2, 7), arrival=1, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)

    out, _ = step(sched)
    assert [held(sched, s).block_ids for s in out.scheduled] == [[0, 1], [2, 3]]
    out, _ = step(sched)  # position 7 still fits in each request's second block
    assert num_scheduled(out) == {"a": 1, "b": 1}
    assert free_ids(sched) == []
    assert sorted(blk.block_id for blk in sched.kv.pool.cached.values()) == [0, 1, 2, 3]

    # Position 8 of `a` needs a third block: `b` (latest arrival) is preempted.
    out, outputs = step(sched)
    assert num_scheduled(out) == {"a": 1}
    assert out.preempted_request_ids == ["b"]
    assert held(sched, out.scheduled[0]).block_ids == [
        0,
        1,
        3,
    ]  # b's freed tail block was evicted first
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert b.output_token_ids == [TOK, TOK]
    assert sched.kv.get_block_ids("b") == []
    assert ids(sched.waiting) == ["b"]
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "length")]
    assert sched.running == []
    assert free_ids(sched) == [2, 3, 1, 0]
    assert sched.stats().num_preemptions == 1

    # `b` recomputes prompt + outputs; its first block is still cached.
    out, outputs = step(sched)
    assert out.finished_request_ids == ["a"]
    assert out.preempted_request_ids == []
    (s,) = out.scheduled
    assert (s.request_id, s.start, s.token_ids) == ("b", 4, b.all_token_ids[4:9])
    assert held(sched, s).block_ids == [2, 3, 1]
    assert s.sample_ids == ["b"]
    assert b.num_cached_tokens == 0  # reported for the first scheduling only
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("b", [TOK], "length")
    ]
    assert b.output_token_ids == [TOK, TOK, TOK]
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (7 + 7 + 9, 4)

    out, _ = step(sched)
    assert out.finished_request_ids == ["b"]
    assert out.is_empty
    assert_pool_all_free(sched)
    assert not sched.has_unfinished_requests()


def test_preemption_evicts_lowest_priority_even_if_it_arrived_first():
    sched = make_scheduler(num_blocks=4, policy="priority")
    low = make_request("low", prompt(1, 7), arrival=0, priority=1)
    sched.add_request(low)
    step(sched)
    high = make_request("high", prompt(2, 7), arrival=1, priority=0)
    sched.add_request(high)
    out, _ = step(sched)
    assert num_scheduled(out) == {"low": 1, "high": 7}
    assert ids(sched.running) == ["low", "high"]
    assert free_ids(sched) == []

    # `low` needs a block for position 8; it is itself the victim.
    out, _ = step(sched)
    assert out.preempted_request_ids == ["low"]
    assert num_scheduled(out) == {"high": 1}
    assert ids(sched.running) == ["high"]
    assert ids(sched.waiting) == ["low"]
    assert low.num_computed_tokens == 0
    assert sched.kv.get_block_ids("high") == [2, 3]
    assert free_ids(sched) == [1, 0]


def test_fcfs_preempts_the_latest_arrival_whatever_its_priority():
    """fcfs ignores priority in preemption too: the most recently arrived running request is
    the victim (as vLLM's fcfs), even when an earlier one has a worse priority."""
    sched = make_scheduler(num_blocks=4, policy="fcfs")
    early = make_request("early", prompt(1, 7), arrival=0, priority=5)
    late = make_request("late", prompt(2, 7), arrival=1, priority=-5)
    sched.add_request(early)
    sched.add_request(late)
    out, _ = step(sched)
    assert num_scheduled(out) == {"early": 7, "late": 7}
    step(sched)  # position 7 still fits in each request's second block
    assert free_ids(sched) == []

    # `early` needs a block for position 8: `late` (latest arrival) is preempted, not `early`.
    out, _ = step(sched)
    assert out.preempted_request_ids == ["late"]
    assert num_scheduled(out) == {"early": 1}
    assert ids(sched.running) == ["early"]
    assert ids(sched.waiting) == ["late"]
    assert late.status == RequestStatus.PREEMPTED and late.num_computed_tokens == 0
    assert early.num_preemptions == 0 and late.num_preemptions == 1
    assert sched.kv.get_block_ids("early") == [0, 1, 3]


def test_fcfs_preempts_by_arrival_not_by_admission_order():
    """The victim is the latest arrival even when the running list holds it before an earlier
    arrival (here a request is added to the running list out of arrival order)."""
    sched = make_scheduler(num_blocks=4, policy="fcfs")
    a = make_request("a", prompt(1, 7), arrival=0, priority=3)
    b = make_request("b", prompt(2, 7), arrival=1, priority=0)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    step(sched)
    sched.running.reverse()  # [b, a]: arrival, not list position, picks the victim
    out, _ = step(sched)  # b needs a block for position 8
    assert out.preempted_request_ids == ["b"]
    assert num_scheduled(out) == {"a": 1}
    assert ids(sched.running) == ["a"]


@pytest.mark.parametrize("priority", [1.5, 1.0, "1", None, True])
def test_non_integer_priority_is_a_value_error(priority: object) -> None:
    with pytest.raises(ValueError, match="priority must be an int"):
        EngineRequest("r", [1, 2, 3], SamplingParams(), priority=priority)  # type: ignore[arg-type]


def test_preempting_an_already_scheduled_request_skips_no_other_running_request():
    sched = make_scheduler(num_blocks=3, policy="priority")
    y = make_request("y", prompt(1, 2), arrival=0, priority=1)
    sched.add_request(y)
    step(sched)
    sched.add_request(make_request("z", prompt(2, 4), arrival=1, priority=0))
    sched.add_request(make_request("w", prompt(3, 2), arrival=2, priority=0))
    out, _ = step(sched)
    assert list(num_scheduled(out)) == ["y", "z", "w"]
    assert free_ids(sched) == []

    # `y` fits and is scheduled first; then `z` needs a block and `y` (lowest priority) is
    # preempted, giving its budget back. `w` still gets its decode token.
    out, _ = step(sched)
    assert out.preempted_request_ids == ["y"]
    assert list(num_scheduled(out).items()) == [("z", 1), ("w", 1)]
    assert sched.kv.get_block_ids("z") == [1, 0]
    assert sched.kv.get_block_ids("w") == [2]
    assert ids(sched.running) == ["z", "w"]
    assert ids(sched.waiting) == ["y"]
    assert y.num_computed_tokens == 0


def test_no_admission_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=4)
    sched.add_request(make_request("a", prompt(1, 7), arrival=0))
    sched.add_request(make_request("b", prompt(2, 7), arrival=1))
    step(sched)
    step(sched)
    sched.add_request(make_request("c", prompt(3, 1), arrival=2))
    out, _ = step(sched)
    assert out.preempted_request_ids == ["b"]
    assert num_scheduled(out) == {"a": 1}
    assert ids(sched.waiting) == ["b", "c"]  # the preempted request keeps its place


# ---- stop conditions --------------------------------------------------------------------


def run_until_finished(
    sched: Scheduler, req: Request, token_for: Callable[[int], int]
) -> list[EngineCoreOutput]:
    outputs: list[EngineCoreOutput] = []
    for i in range(20):
        _, outs = step(sched, {req.request_id: token_for(i)})
        outputs += outs
        if req.is_finished:
            return outputs
    raise AssertionError("request did not finish")


@pytest.mark.parametrize(
    "params, tokens, finish_reason, stop_reason, num_output",
    [
        ({}, [TOK, EOS], "stop", None, 2),
        ({"stop_token_ids": [5]}, [TOK, TOK, 5], "stop", 5, 3),
        ({"max_tokens": 2}, [TOK], "length", None, 2),
        ({"min_tokens": 2}, [EOS, EOS], "stop", None, 2),
        ({"min_tokens": 3, "stop_token_ids": [5]}, [5, 5, 5], "stop", 5, 3),
        ({"min_tokens": 2, "max_tokens": 2}, [EOS], "stop", None, 2),  # stop beats length
        ({"ignore_eos": True, "max_tokens": 3}, [EOS], "length", None, 3),
        ({"ignore_eos": True, "stop_token_ids": [EOS]}, [TOK, EOS], "stop", EOS, 2),
    ],
)
def test_stop_conditions(params, tokens, finish_reason, stop_reason, num_output):
    sched = make_scheduler()
    params = {"max_tokens": 10, **params}
    req = make_request("a", prompt(1, 4), arrival=0, **params)
    sched.add_request(req)
    outputs = run_until_finished(sched, req, lambda i: tokens[min(i, len(tokens) - 1)])
    expected_tokens = [tokens[min(i, len(tokens) - 1)] for i in range(num_output)]
    assert req.output_token_ids == expected_tokens
    assert [o.new_token_ids for o in outputs] == [[t] for t in expected_tokens]
    assert [o.finish_reason for o in outputs] == [None] * (num_output - 1) + [finish_reason]
    assert outputs[-1].stop_reason == stop_reason
    assert req.status == (
        RequestStatus.FINISHED_STOPPED
        if finish_reason == "stop"
        else RequestStatus.FINISHED_LENGTH_CAPPED
    )
    assert sched.requests == {} and sched.running == [] and sched.waiting == []
    assert_pool_all_free(sched)
    assert sched.schedule().finished_request_ids == ["a"]


def test_stop_at_max_model_len():
    sched = make_scheduler(max_model_len=6)
    req = make_request("a", prompt(1, 4), arrival=0, max_tokens=16)
    sched.add_request(req)
    outputs = run_until_finished(sched, req, lambda i: TOK)
    assert [o.finish_reason for o in outputs] == [None, "length"]
    assert req.num_tokens == 6


# ---- abort ------------------------------------------------------------------------------


def test_abort_running_request_frees_its_blocks():
    sched = make_scheduler(num_blocks=8)
    a = make_request("a", prompt(1, 6), arrival=0)
    sched.add_request(a)
    step(sched)
    assert sched.kv.get_block_ids("a") == [0, 1]

    assert sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == [a]
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert a.status.finish_reason == "abort"
    assert sched.requests == {} and sched.running == [] and sched.waiting == []
    assert_pool_all_free(sched)
    assert free_ids(sched) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.finished_request_ids == ["a"]
    assert out.is_empty
    assert sched.schedule().finished_request_ids == []


def test_abort_mid_prefill_and_waiting_requests():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=4)
    sched.add_request(make_request("a", prompt(1, 10), arrival=0))
    sched.add_request(make_request("b", prompt(2, 4), arrival=1))
    step(sched)
    assert sched.kv.get_block_ids("a") == [0]
    assert ids(sched.waiting) == ["b"]

    aborted = sched.finish_requests(["b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert ids(aborted) == ["b"]
    assert sched.waiting == []
    assert ids(sched.running) == ["a"]

    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert_pool_all_free(sched)
    assert sched.requests == {}
    assert sched.schedule().finished_request_ids == ["b", "a"]


def test_abort_between_schedule_and_update():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_request("a", prompt(1, 6), arrival=0))
    out = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.update(out, RunnerOutput({"a": [TOK]}, logprobs={}, prompt_logprobs={})) == []
    assert_pool_all_free(sched)


def test_abort_n_samples_after_fork_frees_everything():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_request("a", prompt(1, 6), arrival=0, n=3))
    step(sched)
    step(sched)  # each sample copies-on-write its last block
    assert ids(sched.running) == ["a", "a#1", "a#2"]
    assert ref_cnts(sched)[:4] == [3, 1, 1, 1]

    aborted = sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sorted(ids(aborted)) == ["a", "a#1", "a#2"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    assert sched.requests == {} and sched.running == []
    assert_pool_all_free(sched)
    assert sorted(sched.schedule().finished_request_ids) == ["a", "a#1", "a#2"]


def test_abort_n_samples_while_siblings_wait_for_fork():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=4)
    sched.add_request(make_request("a", prompt(1, 6), arrival=0, n=3))
    step(sched)
    assert [sched.requests[r].status for r in ("a#1", "a#2")] == [
        RequestStatus.WAITING_FOR_FORK
    ] * 2
    aborted = sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sorted(ids(aborted)) == ["a", "a#1", "a#2"]
    assert sched.requests == {} and sched.running == [] and sched.waiting == []
    assert_pool_all_free(sched)


def test_abort_one_sample_keeps_the_others():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_request("a", prompt(1, 6), arrival=0, n=3))
    step(sched)
    step(sched)
    assert [sched.kv.get_block_ids(r) for r in ("a", "a#1", "a#2")] == [[0, 2], [0, 3], [0, 1]]
    aborted = sched.finish_requests(["a#1"], RequestStatus.FINISHED_ABORTED, all_samples=False)
    assert ids(aborted) == ["a#1"]
    assert ids(sched.running) == ["a", "a#2"]
    assert ref_cnts(sched)[:4] == [2, 1, 1, 0]
    assert free_ids(sched) == [4, 5, 6, 7, 3]


# ---- n > 1 ------------------------------------------------------------------------------


def test_n_siblings_wait_and_fork_when_the_leader_prompt_completes():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=4)
    a = make_request("a", prompt(1, 6), arrival=0, n=3)
    sched.add_request(a)
    s1, s2 = a.siblings
    assert ids(sched.waiting) == ["a"]
    assert set(sched.requests) == {"a", "a#1", "a#2"}

    out, outputs = step(sched)
    assert num_scheduled(out) == {"a": 4}
    assert out.scheduled[0].sample_ids == []
    assert outputs == []
    assert [s1.status, s2.status] == [RequestStatus.WAITING_FOR_FORK] * 2
    assert ids(sched.running) == ["a"]
    assert sched.stats().num_waiting == 2

    out, outputs = step(sched, {"a": 11, "a#1": 12, "a#2": 13})
    (s,) = out.scheduled
    assert (s.start, s.sample_ids, s.sample_indices) == (4, ["a", "a#1", "a#2"], [0, 1, 2])
    assert [(o.request_id, o.parent_id, o.sample_index, o.new_token_ids) for o in outputs] == [
        ("a", "a", 0, [11]),
        ("a#1", "a", 1, [12]),
        ("a#2", "a", 2, [13]),
    ]
    assert ids(sched.running) == ["a", "a#1", "a#2"]
    assert all(r.status == RequestStatus.RUNNING for r in (a, s1, s2))
    assert [r.num_computed_tokens for r in (a, s1, s2)] == [6, 6, 6]
    assert [r.output_token_ids for r in (a, s1, s2)] == [[11], [12], [13]]
    assert [sched.kv.get_block_ids(r) for r in ("a", "a#1", "a#2")] == [[0, 1]] * 3
    assert ref_cnts(sched)[:3] == [3, 3, 0]

    # Each sample writes position 6 into the shared partial block 1: two copies, the last
    # sample keeps block 1.
    out, _ = step(sched)
    assert [(s.request_id, s.start, s.token_ids) for s in out.scheduled] == [
        ("a", 6, [11]),
        ("a#1", 6, [12]),
        ("a#2", 6, [13]),
    ]
    assert out.block_copies == [(1, 2), (1, 3)]
    assert [held(sched, s).block_ids for s in out.scheduled] == [[0, 2], [0, 3], [0, 1]]
    assert ref_cnts(sched)[:4] == [3, 1, 1, 1]

    out, _ = step(sched)
    assert out.block_copies == []


def test_n_block_aligned_prompt_needs_no_copy():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_request("a", prompt(1, 8), arrival=0, n=2))
    step(sched)
    assert ref_cnts(sched)[:2] == [2, 2]
    out, _ = step(sched)
    assert out.block_copies == []
    assert [held(sched, s).block_ids for s in out.scheduled] == [[0, 1, 2], [0, 1, 3]]
    assert ref_cnts(sched)[:4] == [2, 2, 1, 1]


def test_n_samples_finishing_at_first_token_free_everything():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_request("a", prompt(1, 6), arrival=0, n=2, max_tokens=1))
    _, outputs = step(sched)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [
        ("a", "length"),
        ("a#1", "length"),
    ]
    assert sched.requests == {} and sched.running == []
    assert_pool_all_free(sched)


def test_max_num_seqs_counts_waiting_siblings():
    sched = make_scheduler(max_num_seqs=3)
    sched.add_request(make_request("a", prompt(1, 4), arrival=0, max_tokens=1))
    sched.add_request(make_request("b", prompt(2, 4), arrival=1, n=3))
    out, _ = step(sched)
    assert list(num_scheduled(out)) == ["a"]
    assert ids(sched.waiting) == ["b"]
    out, _ = step(sched)
    assert list(num_scheduled(out)) == ["b"]
    assert ids(sched.running) == ["b", "b#1", "b#2"]


def test_n_leader_preempted_mid_prompt_siblings_still_fork_on_resume():
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=8)
    sched.add_request(make_request("x", prompt(1, 4), arrival=0, max_tokens=2))
    lead = make_request("l", prompt(2, 8), arrival=1, n=2)
    sched.add_request(lead)
    out, _ = step(sched)
    assert num_scheduled(out) == {"x": 4, "l": 4}
    assert out.scheduled[1].sample_ids == []

    out, _ = step(sched)  # x takes the last block for position 4; l preempts itself
    assert out.preempted_request_ids == ["l"]
    assert num_scheduled(out) == {"x": 1}
    assert lead.siblings[0].status == RequestStatus.WAITING_FOR_FORK

    out, _ = step(sched)
    assert out.finished_request_ids == ["x"]
    (s,) = out.scheduled
    assert (s.request_id, s.start, s.sample_ids) == ("l", 4, ["l", "l#1"])
    assert ids(sched.running) == ["l", "l#1"]
    assert sched.kv.get_block_ids("l#1") == sched.kv.get_block_ids("l")


# ---- prefix cache and stats -------------------------------------------------------------


def test_second_identical_request_reports_cached_tokens():
    sched = make_scheduler(num_blocks=8)
    p = prompt(1, 10)
    sched.add_request(make_request("a", p, arrival=0, max_tokens=1))
    _, outputs = step(sched)
    assert [(o.request_id, o.num_cached_tokens) for o in outputs] == [("a", 0)]

    b = make_request("b", p, arrival=1, max_tokens=2)
    sched.add_request(b)
    out, outputs = step(sched)
    (s,) = out.scheduled
    assert (s.request_id, s.start, s.token_ids) == ("b", 8, p[8:10])
    assert held(sched, s).block_ids == [0, 1, 3]
    assert b.num_cached_tokens == 8
    assert [(o.request_id, o.num_cached_tokens) for o in outputs] == [("b", 8)]
    assert ref_cnts(sched)[:4] == [1, 1, 0, 1]
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)


def test_prefix_caching_disabled():
    sched = make_scheduler(num_blocks=8, enable_caching=False)
    p = prompt(1, 10)
    sched.add_request(make_request("a", p, arrival=0, max_tokens=1))
    step(sched)
    b = make_request("b", p, arrival=1)
    sched.add_request(b)
    out, _ = step(sched)
    assert (out.scheduled[0].start, b.num_cached_tokens) == (0, 0)
    assert (sched.stats().prefix_cache_queries, sched.stats().prefix_cache_hits) == (0, 0)


def test_stats():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    sched.add_request(make_request("a", prompt(1, 6), arrival=0))
    sched.add_request(make_request("b", prompt(2, 4), arrival=1, n=2))
    assert (sched.stats().num_running, sched.stats().num_waiting) == (0, 3)
    step(sched)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 2)
    assert stats.kv_cache_usage == pytest.approx(2 / 8)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (6, 0)
    assert stats.num_preemptions == 0


# ---- prompt logprobs --------------------------------------------------------------------


def step_with_prompt_logprobs(sched: Scheduler) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """Like step(), and the fake runner scores each chunk's prompt rows: row p -> token p + 1."""
    out = sched.schedule()
    sampled = {rid: [TOK] for s in out.scheduled for rid in s.sample_ids}
    plp = {
        s.request_id: [
            (
                [held(sched, s).prompt_token_ids[s.start + s.prompt_logprob_offset + 1 + j]],
                [-1.0],
                1,
            )
            for j in range(s.num_prompt_logprob_tokens)
        ]
        for s in out.scheduled
        if s.num_prompt_logprob_tokens
    }
    return out, sched.update(out, RunnerOutput(sampled, logprobs={}, prompt_logprobs=plp))


def test_prompt_logprob_rows_per_chunk():
    sched = make_scheduler(max_num_batched_tokens=4)
    p = prompt(1, 10)
    sched.add_request(make_request("a", p, arrival=0, prompt_logprobs=1))
    scored: list[int] = []
    rows = []
    for _ in range(4):
        out, outputs = step_with_prompt_logprobs(sched)
        rows.append(out.scheduled[0].num_prompt_logprob_tokens)
        assert len(outputs) == 1  # a prompt-only chunk still reports its logprobs
        scored += [e[0][0] for o in outputs for e in o.new_prompt_logprobs]
    assert rows == [4, 4, 1, 0]
    assert scored == p[1:]


def test_prompt_logprobs_reported_once_across_preemption():
    sched = make_scheduler(num_blocks=3)
    sched.add_request(make_request("a", prompt(1, 7), arrival=0, max_tokens=3))
    r = make_request("r", prompt(2, 3), arrival=1, max_tokens=4, prompt_logprobs=0)
    sched.add_request(r)
    scored: list[int] = []
    preempted = False
    while sched.has_unfinished_requests():
        out, outputs = step_with_prompt_logprobs(sched)
        preempted |= "r" in out.preempted_request_ids
        scored += [e[0][0] for o in outputs if o.request_id == "r" for e in o.new_prompt_logprobs]
    assert preempted
    assert scored == r.prompt_token_ids[1:]


# ---- async scheduling: schedule() of step k + 1 runs before update() of step k ----------


def runner_output(out: SchedulerOutput, tokens: dict[str, int]) -> RunnerOutput:
    """The fake runner's result of `out`: tokens[rid] for every sampling id."""
    sampled = {rid: [tokens[rid]] for s in out.scheduled for rid in s.sample_ids}
    return RunnerOutput(sampled, logprobs={}, prompt_logprobs={})


def cached_ids(sched: Scheduler) -> list[int]:
    return sorted(b.block_id for b in sched.kv.pool.cached.values())


def test_async_decode_from_placeholder_and_no_step_past_max_tokens():
    sched = make_scheduler()
    p = prompt(1, 6)
    a = make_request("a", p, arrival=0, max_tokens=3)
    sched.add_request(a)

    out1 = sched.schedule()
    assert [(s.start, s.token_ids, s.sample_ids) for s in out1.scheduled] == [(0, p, ["a"])]
    assert (a.num_computed_tokens, a.num_output_placeholders) == (6, 1)

    # Step 2 is scheduled while step 1 is in flight: its input is step 1's unknown token.
    out2 = sched.schedule()
    s = out2.scheduled[0]
    assert (s.start, s.token_ids, s.sample_ids) == (6, [PLACEHOLDER_TOKEN_ID], ["a"])
    assert s.num_output_tokens == 1 and held(sched, s).output_token_ids == []
    assert held(sched, s).block_ids == [0, 1]
    assert (a.num_computed_tokens, a.num_output_placeholders) == (7, 2)

    outputs = sched.update(out1, runner_output(out1, {"a": 11}))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("a", [11], None)
    ]
    assert a.all_token_ids == p + [11] and a.num_output_placeholders == 1
    assert cached_ids(sched) == [0]  # block 1 holds position 6, computed but not yet known

    out3 = sched.schedule()
    s = out3.scheduled[0]
    assert (s.start, s.token_ids, s.num_output_tokens) == (7, [PLACEHOLDER_TOKEN_ID], 2)
    assert sched.update(out2, runner_output(out2, {"a": 12}))[0].new_token_ids == [12]
    assert cached_ids(sched) == [0]

    # Steps 2 and 3 sample outputs 2 and 3 = max_tokens: a fourth step would be wasted.
    out4 = sched.schedule()
    assert out4.is_empty and ids(sched.running) == ["a"]
    outputs = sched.update(out3, runner_output(out3, {"a": 13}))
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([13], "length")]
    assert a.output_token_ids == [11, 12, 13] and a.num_output_placeholders == 0
    assert sched.update(out4, runner_output(out4, {})) == []
    assert_pool_all_free(sched)
    assert not sched.has_unfinished_requests()


def test_async_stop_while_next_step_in_flight_and_id_reused():
    sched = make_scheduler()
    old = make_request("a", prompt(1, 4), arrival=0, max_tokens=10)
    sched.add_request(old)
    out1 = sched.schedule()
    out2 = sched.schedule()  # old's next decode, in flight when old stops
    outputs = sched.update(out1, runner_output(out1, {"a": EOS}))
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([EOS], "stop")]
    assert_pool_all_free(sched)

    new = make_request("a", prompt(2, 4), arrival=1, max_tokens=10)
    sched.add_request(new)
    out3 = sched.schedule()
    assert out3.finished_request_ids == ["a"]  # the old one: the runner drops its state
    assert [(s.start, s.token_ids) for s in out3.scheduled] == [(0, prompt(2, 4))]
    # Step 2's token belongs to the old request object: dropped, the new one is untouched.
    assert sched.update(out2, runner_output(out2, {"a": 99})) == []
    assert new.output_token_ids == [] and new.num_output_placeholders == 1
    assert sched.update(out3, runner_output(out3, {"a": 5}))[0].new_token_ids == [5]
    assert old.output_token_ids == [EOS] and new.output_token_ids == [5]


def test_async_abort_while_two_steps_in_flight():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt(1, 4), arrival=0))
    sched.add_request(make_request("b", prompt(2, 4), arrival=1))
    out1 = sched.schedule()
    out2 = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.get_block_ids("a") == []
    outputs = sched.update(out1, runner_output(out1, {"a": 11, "b": 12}))
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("b", [12])]
    out3 = sched.schedule()
    assert out3.finished_request_ids == ["a"] and num_scheduled(out3) == {"b": 1}
    outputs = sched.update(out2, runner_output(out2, {"a": 21, "b": 22}))
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("b", [22])]
    assert sched.requests["b"].output_token_ids == [12, 22]


def test_async_preempted_with_placeholder_gets_its_token_then_recomputes():
    sched = make_scheduler(num_blocks=3)
    a = make_request("a", prompt(1, 4), arrival=0, max_tokens=2)
    b = make_request("b", prompt(2, 4), arrival=1, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    out1 = sched.schedule()
    assert num_scheduled(out1) == {"a": 4, "b": 4}
    # Both decode into a second block; the pool has one: b, the latest, is preempted with
    # its step-1 token still in flight.
    out2 = sched.schedule()
    assert num_scheduled(out2) == {"a": 1} and out2.preempted_request_ids == ["b"]
    assert (b.status, b.num_computed_tokens, b.num_output_placeholders) == (
        RequestStatus.PREEMPTED,
        0,
        1,
    )
    assert ids(sched.waiting) == ["b"] and sched.kv.get_block_ids("b") == []

    outputs = sched.update(out1, runner_output(out1, {"a": 11, "b": 12}))
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", [11]), ("b", [12])]
    assert b.all_token_ids == prompt(2, 4) + [12] and b.num_output_placeholders == 0
    assert b.status == RequestStatus.PREEMPTED and sched.kv.get_block_ids("b") == []

    out3 = sched.schedule()  # a samples its last token in step 2; b does not fit yet
    assert out3.is_empty and ids(sched.waiting) == ["b"]
    outputs = sched.update(out2, runner_output(out2, {"a": 13}))
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "length")]
    sched.update(out3, runner_output(out3, {}))

    out4 = sched.schedule()
    s = out4.scheduled[0]
    assert (s.request_id, s.start, s.token_ids) == ("b", 0, prompt(2, 4) + [12])
    assert s.sample_ids == ["b"] and s.num_output_tokens == 1


def test_async_leader_preempted_before_fork_sends_samples_to_recompute():
    sched = make_scheduler(num_blocks=2)
    c = make_request("c", prompt(0, 4), arrival=0, max_tokens=2)
    lead = make_request("l", prompt(1, 4), arrival=1, n=2, max_tokens=4)
    sched.add_request(c)
    sched.add_request(lead)
    out1 = sched.schedule()
    assert [s.sample_ids for s in out1.scheduled] == [["c"], ["l", "l#1"]]
    out2 = sched.schedule()  # c needs a second block: the leader is preempted before its fork
    assert num_scheduled(out2) == {"c": 1} and out2.preempted_request_ids == ["l"]

    outputs = sched.update(out1, runner_output(out1, {"c": 11, "l": 12, "l#1": 13}))
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [
        ("c", [11]),
        ("l", [12]),
        ("l#1", [13]),
    ]
    sibling = sched.requests["l#1"]
    assert ids(sched.waiting) == ["l", "l#1"]
    assert (sibling.status, sibling.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    assert sched.kv.get_block_ids("l#1") == []

    out3 = sched.schedule()
    assert out3.is_empty
    sched.update(out2, runner_output(out2, {"c": 14}))  # c finishes, its blocks free up
    sched.update(out3, runner_output(out3, {}))
    out4 = sched.schedule()
    assert [(s.request_id, s.token_ids) for s in out4.scheduled] == [("l", prompt(1, 4) + [12])]


def test_async_fork_shares_only_the_prompt_blocks():
    sched = make_scheduler()
    lead = make_request("l", prompt(1, 8), arrival=0, n=2, max_tokens=4)
    sched.add_request(lead)
    out1 = sched.schedule()
    out2 = sched.schedule()  # the leader's decode at position 8 takes a third block
    assert sched.kv.get_block_ids("l") == [0, 1, 2]
    sched.update(out1, runner_output(out1, {"l": 11, "l#1": 12}))
    sibling = sched.requests["l#1"]
    assert sched.kv.get_block_ids("l#1") == [0, 1]
    assert sibling.num_computed_tokens == 8 and sibling.all_token_ids == prompt(1, 8) + [12]
    assert ref_cnts(sched)[:3] == [2, 2, 1]
    out3 = sched.schedule()
    assert [(s.request_id, s.start, s.token_ids) for s in out3.scheduled] == [
        ("l", 9, [PLACEHOLDER_TOKEN_ID]),
        ("l#1", 8, [12]),
    ]
    assert sched.kv.get_block_ids("l#1") == [0, 1, 3]
    sched.update(out2, runner_output(out2, {"l": 21}))
    sched.update(out3, runner_output(out3, {"l": 31, "l#1": 32}))
    assert lead.output_token_ids == [11, 21, 31] and sibling.output_token_ids == [12, 32]


@pytest.mark.parametrize("max_model_len, expected_blocks", [(1024, [1, 3, 3]), (8, [1, 2])])
def test_lookahead_slots_follow_sampling_steps(
    max_model_len: int, expected_blocks: list[int]
) -> None:
    """A draft model writes its proposals' KV up to k positions past a sampling step's tokens:
    those steps allocate k lookahead slots (within max_model_len); a prefill chunk that samples
    nothing allocates none."""
    kv = KVCacheManager(BlockPool(16, False), BS)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4)
    sched = Scheduler(config, kv, max_model_len, num_lookahead_tokens=3)
    sched.add_request(make_request("a", prompt(0, 6), arrival=0, max_tokens=3))
    blocks = []
    while sched.has_unfinished_requests():
        step(sched)
        if "a" in kv.req_blocks:
            blocks.append(len(kv.get_block_ids("a")))
    # chunk [0, 4): 1 block; chunk [4, 6) samples: 6 + 3 slots in 3 blocks; the decode at 6:
    # 7 + 3 slots, 3 blocks (the last step finishes the request and frees them). At max_model_len
    # 8: min(3, 8 - 6) = 2 slots, 2 blocks, and the next step reaches the length cap.
    assert blocks == expected_blocks


@pytest.mark.parametrize("seed", range(12))
def test_never_more_requests_in_a_step_than_max_num_seqs(seed: int) -> None:
    """Random arrivals (n = 1 and 2), lengths, EOS and aborts in a small pool: every step runs at
    most max_num_seqs requests and max_num_batched_tokens tokens. (A request admitted while a
    running leader's sibling still waited to fork once made three requests in a step of two,
    which the runner's buffers refuse: the soak of issue 20 killed the engine with it.)"""
    import random

    rng = random.Random(seed)
    budget = rng.choice([16, 64])
    sched = make_scheduler(
        num_blocks=rng.choice([12, 24, 64]), max_num_seqs=2, max_num_batched_tokens=budget
    )
    for t in range(300):
        if rng.random() < 0.3:
            sched.add_request(
                make_request(
                    f"r{t}",
                    prompt(t, rng.randint(1, 30)),
                    arrival=t,
                    n=rng.choice([1, 1, 2]),
                    max_tokens=rng.randint(1, 12),
                    temperature=1.0,
                )
            )
        if rng.random() < 0.05 and sched.requests:
            victim = rng.choice(list(sched.requests.values()))
            whole = rng.random() < 0.5
            rid = victim.parent_id if whole else victim.request_id
            sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED, all_samples=whole)
        out = sched.schedule()
        assert len(out.scheduled) <= 2, [s.request_id for s in out.scheduled]
        assert out.num_scheduled_tokens <= budget
        sampled = {
            rid: [EOS if rng.random() < 0.1 else TOK] for s in out.scheduled for rid in s.sample_ids
        }
        sched.update(out, RunnerOutput(sampled, logprobs={}, prompt_logprobs={}))
