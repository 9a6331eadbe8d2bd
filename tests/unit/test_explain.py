"""Request timelines for `explain` (pagoda/scheduling/explain.py), on scripted scheduler runs:
why a request waited at each step (no free blocks, a step that preempted, the token budget,
max_num_seqs, a request of higher priority ahead), its admissions with prefix-cache hits, prefill
chunks, decode steps, preemptions, finish and share of the engine's steps; the last N finished
kept."""

from __future__ import annotations

from typing import Any

from pagoda.scheduling.explain import Explainer
from pagoda.scheduling.messages import RunnerOutput
from pagoda.scheduling.scheduler import Scheduler
from tests.unit.test_scheduler import TOK, make_request, make_scheduler, prompt, step


def _events(t: dict[str, Any]) -> list[tuple[Any, ...]]:
    """(event, first step, steps, reason or tokens) per timeline entry."""
    return [
        (e["event"], e["step"], e["num_steps"], e.get("reason", e.get("num_tokens")))
        for e in t["timeline"]
    ]


def _explain(sched: Scheduler, rid: str) -> dict[str, Any]:
    t = sched.explainer.explain(rid, sched.step_id)
    assert t is not None
    return t


def test_a_request_that_waits_for_blocks_is_preempted_and_resumes() -> None:
    sched = make_scheduler(num_blocks=4)  # blocks of 4 tokens: two 7-token prompts fill it
    a = make_request("a", prompt(1, 7), arrival=0, max_tokens=3)
    b = make_request("b", prompt(2, 7), arrival=1, max_tokens=3)
    c = make_request("c", prompt(3, 7), arrival=2, max_tokens=2)
    for r in (a, b, c):
        sched.add_request(r)
    steps = []
    for _ in range(7):
        out, _ = step(sched)
        steps.append(
            ({s.request_id: len(s.token_ids) for s in out.scheduled}, out.preempted_request_ids)
        )
    assert steps[:6] == [
        ({"a": 7, "b": 7}, []),
        ({"a": 1, "b": 1}, []),
        ({"a": 1}, ["b"]),  # a's 9th position needs a third block: b (latest) gives its two
        ({"b": 5}, []),  # b recomputes 9 tokens, its first block still cached
        ({"c": 7}, []),
        ({"c": 1}, []),
    ]
    tb = _explain(sched, "b")
    assert _events(tb) == [
        ("arrived", 1, 1, None),
        ("admitted", 1, 1, None),
        ("prefill", 1, 1, 7),
        ("decode", 2, 1, None),
        ("preempted", 3, 1, "no_free_blocks"),
        ("waited", 3, 1, "preemption"),
        ("admitted", 4, 1, None),
        ("prefill", 4, 1, 5),
        ("finished", 4, 1, None),
    ]
    assert tb["timeline"][4]["for_request_id"] == "a"
    assert (
        tb["timeline"][6]["num_cached_tokens"] == 4
        and len(tb["timeline"][6]["cached_block_ids"]) == 1
    )
    assert (tb["num_preemptions"], tb["num_prefill_chunks"], tb["num_decode_steps"]) == (1, 2, 1)
    assert tb["steps_waited"] == {"preemption": 1}
    assert (tb["finish_reason"], tb["num_steps_scheduled"], tb["share_of_steps"]) == (
        "length",
        3,
        0.75,
    )

    tc = _explain(sched, "c")
    assert _events(tc) == [
        ("arrived", 1, 1, None),
        ("waited", 1, 2, "no_free_blocks"),  # steps 1-2: a and b hold every block
        ("waited", 3, 1, "preemption"),  # a step that preempts admits nobody
        ("waited", 4, 1, "no_free_blocks"),  # b's recompute takes three
        ("admitted", 5, 1, None),
        ("prefill", 5, 1, 7),
        ("decode", 6, 1, None),
        ("finished", 6, 1, None),
    ]
    assert tc["steps_waited"] == {"no_free_blocks": 3, "preemption": 1}
    assert tc["num_steps_scheduled"] == 2 and tc["share_of_steps"] == round(2 / 6, 4)
    ta = _explain(sched, "a")
    assert ta["steps_waited"] == {} and ta["num_decode_steps"] == 2 and ta["share_of_steps"] == 1.0


def test_token_budget_and_max_num_seqs_and_priority_are_told_apart() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2, policy="priority")
    a = make_request("a", prompt(1, 6), arrival=0, max_tokens=4)
    b = make_request("b", prompt(2, 6), arrival=1, max_tokens=4)
    c = make_request("c", prompt(3, 6), arrival=2, max_tokens=4)
    d = make_request("d", prompt(4, 6), arrival=3, max_tokens=4, priority=5)
    for r in (a, b, c, d):
        sched.add_request(r)
    out, _ = step(sched)  # a 6, b 2 (a chunk): the budget is spent, c and d wait
    assert {s.request_id: len(s.token_ids) for s in out.scheduled} == {"a": 6, "b": 2}
    out, _ = step(sched)  # a decodes, b's next 4: two seats taken
    assert {s.request_id: len(s.token_ids) for s in out.scheduled} == {"a": 1, "b": 4}
    assert _events(_explain(sched, "c"))[1:] == [
        ("waited", 1, 1, "token_budget"),
        ("waited", 2, 1, "max_num_seqs"),
    ]
    # d (priority 5) stays behind c (priority 0) whatever stops c
    assert _events(_explain(sched, "d"))[1:] == [("waited", 1, 2, "lower_priority")]
    assert _events(_explain(sched, "b"))[2:] == [("prefill", 1, 1, 2), ("prefill", 2, 1, 4)]


def test_a_running_request_the_budget_left_out_waited_for_it() -> None:
    # (the scheduler reports those when running requests' drafts or chunks spend the budget)
    explainer = Explainer(keep=4)
    a = make_request("a", prompt(1, 3), arrival=0)
    explainer.arrived(a, 1)
    explainer.step(1, {"a": a}, {"a": 3}, [], [], None)
    explainer.step(2, {"a": a}, {}, [a], [], None)
    explainer.step(3, {"a": a}, {}, [a], [], None)
    assert _events(explainer.explain("a", 3) or {})[2:] == [("waited", 2, 2, "token_budget")]


def test_the_last_n_finished_are_kept() -> None:
    sched = make_scheduler()
    sched.explainer.keep = 1
    sched.add_request(make_request("a", prompt(1, 3), arrival=0, max_tokens=1))
    sched.add_request(make_request("b", prompt(2, 3), arrival=1, max_tokens=2))
    step(sched)  # a finishes
    assert _explain(sched, "a")["finish_reason"] == "length"
    assert _explain(sched, "b")["finish_step"] is None  # live
    step(sched)  # b finishes: only the later one is kept
    assert sched.explainer.explain("a", sched.step_id) is None
    assert _explain(sched, "b")["finish_step"] == 2
    assert sched.explainer.explain("never", sched.step_id) is None


def test_speculative_drafts_verified_and_accepted() -> None:
    """A request whose decode steps verify drafts (as the runner's proposer leaves them in
    spec_token_ids): each verification's drafts and accepted drafts add up; a request that
    verified none reports no speculative part."""
    sched = make_scheduler()
    a = make_request("a", prompt(1, 5), arrival=0, max_tokens=10)
    b = make_request("b", prompt(2, 5), arrival=1, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # both prefill
    for drafts, sampled in (([7, 8, 9], [7, 8, 5]), ([4, 4], [6])):  # 2 of 3, then 0 of 2
        a.spec_token_ids = drafts
        out = sched.schedule()
        assert {s.request_id: s.num_draft_tokens for s in out.scheduled} == {
            "a": len(drafts),
            "b": 0,
        }
        sched.update(out, RunnerOutput({"a": sampled, "b": [TOK]}, logprobs={}, prompt_logprobs={}))
    assert _explain(sched, "a")["speculative"] == {
        "num_verifications": 2,
        "num_draft_tokens": 5,
        "num_accepted_tokens": 2,
        "acceptance_rate": 0.4,
    }
    assert _explain(sched, "a")["num_decode_steps"] == 2
    assert _explain(sched, "b")["speculative"] is None
