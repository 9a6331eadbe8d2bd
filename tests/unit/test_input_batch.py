"""The runner's persistent batch (runner/input_batch.py) kept by the scheduler's deltas equals
the state built from scratch from the scheduler's requests, step after step: new requests,
continuing ones, preempted and resumed ones, n > 1 forks with copy-on-write, aborts, finishes
and a reused id."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagoda.config import SchedulerConfig
from pagoda.runner.input_batch import BatchColumns, InputBatch, SamplingRows
from pagoda.runner.sampler import Sampler, SamplingMetadata, apply_penalty_counts
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.block_pool import BlockPool
from pagoda.scheduling.kv_cache_manager import KVCacheManager
from pagoda.scheduling.messages import RunnerOutput, SchedulerOutput, sample_request_id
from pagoda.scheduling.request import Request, RequestStatus
from pagoda.scheduling.scheduler import Scheduler
from tests.sampling_reference import apply_penalties, metadata_from_rows

BS = 4
EOS = 2
VOCAB = 1000


def make_request(rid: str, prompt: list[int], params: SamplingParams) -> Request:
    assert params.max_tokens is not None
    reqs = [
        Request(
            sample_request_id(rid, i),
            list(prompt),
            params,
            max_tokens=params.max_tokens,
            eos_token_ids=frozenset({EOS}),
            arrival_time=float(len(rid)),
            parent_id=rid,
            sample_index=i,
        )
        for i in range(params.n)
    ]
    reqs[0].siblings = reqs[1:]
    return reqs[0]


def from_scratch(sched: Scheduler) -> dict[str, tuple]:
    """Every row the runner should hold, built from the scheduler's requests alone."""
    return {
        r.request_id: (
            r.prompt_token_ids,
            r.output_token_ids,
            r.sampling_params,
            sched.kv.get_block_ids(r.request_id),
            r.sample_index,
        )
        for r in sched.requests.values()
        if r.request_id in sched.runner_blocks
    }


def check_penalty_state(sched: Scheduler, batch: InputBatch) -> None:
    """Rows with penalties count exactly their request's outputs and mark its prompt."""
    for rid, row in batch.rows.items():
        if not batch.columns["penalized"][row.slot]:
            continue
        request = sched.requests[rid]
        counts, seen = batch.penalty_state(rid)
        expected = torch.bincount(
            torch.tensor(request.output_token_ids, dtype=torch.int64), minlength=VOCAB
        )
        assert torch.equal(counts, expected.float()), rid
        assert torch.equal(
            seen.nonzero().flatten(), torch.tensor(sorted(set(request.prompt_token_ids)))
        ), rid


def run_step(
    sched: Scheduler, batch: InputBatch, rng: random.Random, check: bool = False
) -> SchedulerOutput:
    """schedule -> apply the deltas (check: then compare with the state built from scratch)
    -> (fake) sample -> record on the runner side -> update."""
    out = sched.schedule()
    held = {rid: len(row.block_ids) for rid, row in batch.rows.items()}
    batch.apply(out)
    out_of_place = [c for c in out.cached_requests if c.start < held[c.request_id]]
    sched.num_copy_on_write = getattr(sched, "num_copy_on_write", 0) + len(out_of_place)
    if check:
        assert batch.state() == from_scratch(sched), f"step {out.step_id}"
        for s in out.scheduled:  # each scheduled request's block table covers its inputs
            assert len(batch.rows[s.request_id].block_ids) * BS >= s.start + len(s.token_ids)
        check_penalty_state(sched, batch)
    rows = SamplingRows()
    for i, s in enumerate(out.scheduled):
        if s.sample_ids:
            rows.add(s, batch.rows[s.request_id], i)
    sampled = {rid: rng.randrange(3, VOCAB) for rid in rows.row_ids}
    batch.count_sampled(rows, torch.tensor(list(sampled.values()), dtype=torch.int64))
    batch.record_sampled(rows.own_rows, list(sampled.values()))
    sched.update(out, RunnerOutput({r: [t] for r, t in sampled.items()}, {}, {}))
    return out


def test_deltas_rebuild_the_state_built_from_scratch() -> None:
    rng = random.Random(0)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24),
        KVCacheManager(BlockPool(14, enable_caching=True), BS),
        max_model_len=64,
    )
    batch = InputBatch(VOCAB, capacity=2)  # grows on demand
    seen = {"new": 0, "appended": 0, "copy_on_write": 0, "preempted": 0, "finished": 0}
    next_id = 0
    for _ in range(120):
        if rng.random() < 0.35 and len(sched.requests) < 8:
            n = rng.choice([1, 1, 2, 3])
            length = rng.randrange(2, 14)
            prompt = [rng.randrange(3, VOCAB) for _ in range(length)]
            params = SamplingParams(
                n=n,
                max_tokens=rng.randrange(1, 12),
                temperature=rng.choice([0.0, 0.8]),
                top_k=rng.choice([0, 5]),
                repetition_penalty=rng.choice([1.0, 1.2]),
                seed=rng.choice([None, 7]),
            )
            sched.add_request(make_request(f"r{next_id}", prompt, params))
            next_id += 1
        if rng.random() < 0.05 and sched.running:
            victim = rng.choice(sched.running).parent_id
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        out = run_step(sched, batch, rng, check=True)
        seen["new"] += len(out.new_requests)
        seen["appended"] += len(out.cached_requests)
        seen["preempted"] += len(out.preempted_request_ids)
        seen["finished"] += len(out.finished_request_ids)
    seen["copy_on_write"] = sched.num_copy_on_write  # a block replaced inside a held table
    assert all(count > 0 for count in seen.values()), seen
    print(seen)


def test_a_reused_id_replaces_the_row_and_a_late_sample_is_dropped() -> None:
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        KVCacheManager(BlockPool(16, enable_caching=False), BS),
        max_model_len=64,
    )
    batch = InputBatch(VOCAB)
    rng = random.Random(1)
    sched.add_request(make_request("a", [5, 6, 7], SamplingParams(max_tokens=8)))
    run_step(sched, batch, rng)
    old_row = batch.rows["a"]
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    sched.add_request(make_request("a", [9, 9], SamplingParams(max_tokens=8, temperature=0.5)))
    out = sched.schedule()
    assert out.finished_request_ids == ["a"] and [n.request_id for n in out.new_requests] == ["a"]
    batch.apply(out)
    assert batch.rows["a"] is not old_row and batch.rows["a"].prompt_token_ids == [9, 9]
    batch.record_sampled([old_row], [42])  # the old request's in-flight sample arrives late
    assert batch.rows["a"].output_token_ids == [] and old_row.output_token_ids != [42]


def test_sampling_columns_follow_the_rows_params() -> None:
    batch = InputBatch(VOCAB, capacity=1)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        KVCacheManager(BlockPool(16, enable_caching=False), BS),
        max_model_len=64,
    )
    params = {
        "g": SamplingParams(temperature=0.0, logprobs=3),
        "t": SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.1, min_tokens=2),
        "p": SamplingParams(temperature=1.0, top_k=VOCAB + 5, presence_penalty=0.5),
    }
    for rid, p in params.items():
        sched.add_request(make_request(rid, [5, 6], p))
    out = sched.schedule()
    batch.apply(out)
    rows = SamplingRows()
    for i, s in enumerate(out.scheduled):
        rows.add(s, batch.rows[s.request_id], i)
    slots = rows.slots_array()
    assert rows.row_ids == ["g", "t", "p"]
    np.testing.assert_array_equal(batch.gather("greedy", slots), [True, False, False])
    np.testing.assert_array_equal(batch.gather("top_k", slots), [0, 4, 0])  # 0: off
    np.testing.assert_allclose(batch.gather("top_p", slots), [1.0, 0.9, 1.0])
    np.testing.assert_allclose(batch.gather("presence_penalty", slots), [0.0, 0.0, 0.5])
    np.testing.assert_array_equal(batch.gather("penalized", slots), [False, False, True])
    np.testing.assert_array_equal(batch.gather("num_logprobs", slots), [3, -1, -1])
    np.testing.assert_array_equal(batch.gather("wants_min_tokens", slots), [False, True, False])
    np.testing.assert_allclose(batch.gather("temperature", slots), [1.0, 0.7, 1.0])


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, top_k=7, repetition_penalty=1.3, seed=1),
    SamplingParams(temperature=0.6, top_p=0.8, presence_penalty=0.7, frequency_penalty=0.4),
    SamplingParams(temperature=1.0, min_p=0.05, min_tokens=3, logit_bias={5: 3.0}),
    SamplingParams(n=2, temperature=0.8, frequency_penalty=-0.5, seed=4),
    SamplingParams(temperature=0.0, allowed_token_ids=[4, 9, 12], logit_bias={9: -2.0}),
    SamplingParams(temperature=0.7, allowed_token_ids=[3, 5, 8, 20], min_tokens=2),
]
# every row greedy: penalties still apply (only the sampling stages are off for greedy rows)
GREEDY = [
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
    SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(temperature=0.0),
]


@pytest.mark.parametrize("choices", [MIXED, GREEDY], ids=["mixed", "all_greedy"])
def test_batch_metadata_samples_as_the_reference_built_from_lists(
    choices: list[SamplingParams],
) -> None:
    """SamplingMetadata.from_batch (columns, device penalty counts) against the reference built
    from the SamplingParams and token lists (tests/sampling_reference.py): the same penalized
    logits and the same sampled tokens."""
    rng = random.Random(3)
    batch = InputBatch(VOCAB, capacity=2)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        KVCacheManager(BlockPool(64, enable_caching=False), BS),
        max_model_len=64,
    )
    for i, params in enumerate(choices):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 9))]
        sched.add_request(make_request(f"q{i}", prompt, params))
    checked_penalties = False
    for _ in range(6):
        out = sched.schedule()
        batch.apply(out)
        rows = SamplingRows()
        for i, s in enumerate(out.scheduled):
            if s.sample_ids:
                rows.add(s, batch.rows[s.request_id], i)
        logits = torch.randn(len(rows.row_ids), VOCAB, generator=torch.Generator().manual_seed(9))
        gens = [torch.Generator().manual_seed(i) for i in range(len(rows.row_ids))]
        columns = BatchColumns.gather(batch, rows, torch.device("cpu"))
        fast = SamplingMetadata.from_batch(columns, batch, rows, dict(enumerate(gens)), [EOS])
        params = [r.params for r in rows.leaders]
        outputs = [r.output_token_ids if r is not None else [] for r in rows.own_rows]
        banned = [
            [EOS, *p.stop_token_ids] if n < p.min_tokens else []
            for p, n in zip(params, rows.num_outputs)
        ]
        gens_ref = [torch.Generator().manual_seed(i) for i in range(len(rows.row_ids))]
        prompts = [r.prompt_token_ids for r in rows.leaders]
        ref = metadata_from_rows(
            params,
            outputs,
            prompts,
            dict(enumerate(gens_ref)),
            banned,
            VOCAB,
            "cpu",
        )
        if not ref.no_penalties:
            checked_penalties = True
            assert fast.output_counts is not None
            # prompt tokens seen are gathered only for repetition penalties
            assert (fast.prompt_seen is None) == (ref.repetition_penalties is None)
            args = (ref.presence_penalties, ref.frequency_penalties, ref.repetition_penalties)
            assert torch.equal(
                apply_penalty_counts(logits, fast.prompt_seen, fast.output_counts, *args),
                apply_penalties(logits, prompts, outputs, *args),
            )
        fast_out, ref_out = Sampler()(logits, fast), Sampler()(logits, ref)
        assert torch.equal(fast_out.sampled_token_ids, ref_out.sampled_token_ids)
        sampled = fast_out.sampled_token_ids
        batch.count_sampled(rows, sampled)
        batch.record_sampled(rows.own_rows, sampled.tolist())
        runner = {rid: [tok] for rid, tok in zip(rows.row_ids, sampled.tolist())}
        sched.update(out, RunnerOutput(runner, logprobs={}, prompt_logprobs={}))
    assert checked_penalties and any(r.output_token_ids for r in sched.requests.values())
