"""Speculative decoding in the runner: verifying a step's draft tokens, proposing the next's.

A request with d draft tokens runs its last token and the d drafts as one chunk of d + 1
positions (the scheduler's ScheduledRequest.num_draft_tokens); where decode steps are
compiled (CPU) or replayed as CUDA graphs, a step without prefills runs its chunks as one-token
decode rows (one_token_rows), so verification takes that path too. Verification samples every
position as the plain sampler samples a row: the same processing (logit bias, min_tokens bans,
penalties counting the drafts before the position, temperature, top-k/p, min-p), the same
exponential race, a seeded request drawing its noise position by position from its generator.
It keeps the longest prefix of drafts equal to those samples, then the sample after it
(runner/rejection_sampler.py: accept_prefixes, on the host, where the step reads its samples
anyway). Drafts here are deterministic (prompt lookup, or a draft model's argmax for greedy
requests), so this is exactly rejection sampling (accept x with
min(1, p(x) / q(x)) for a one-hot q): the output is distributed as the target's, and greedy
output is the target's argmax chain. A seeded request's generator is then rewound to a_r + 1
draws, so it gives the tokens it gives without speculation.

A draft model's drafts for random requests are draws from its processed distribution q
(runner/draft_sampling.py), kept with q; a step where some row has one verifies by rejection
sampling against q (_verify_against_q): draft x kept with min(1, p(x) / q(x)), the first one
rejected replaced by a draw from max(0, p - q) normalised.

Proposals (spec_decode/ngram.py, spec_decode/draft_model.py) are made when a step's tokens
reach the host, from each request's prompt and outputs, within max_tokens and max_model_len;
they ride back to the scheduler in RunnerOutput.draft_token_ids.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import torch
from torch.nn.functional import one_hot

from pagoda.runner.device import to_device
from pagoda.runner.input_batch import InputBatch, RequestRow, SamplingRows
from pagoda.runner.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    DraftLayout,
    accept_prefixes,
    rejection_sample,
    rewind_generators,
    snapshot_generators,
)
from pagoda.runner.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    compute_logprobs_for,
)
from pagoda.spec_decode.draft_model import DraftStepFn
from pagoda.spec_decode.methods import Proposer, ProposerContext, spec_method
from pagoda.speculative_config import SpeculativeConfig


@dataclass
class Verified:
    """A step's emitted tokens, rows in order: row i emitted counts[i] = a_i + 1 of them."""

    sampled: torch.Tensor  # (N,) int64 on the device
    counts: list[int]
    logprobs: LogprobsTensors | None  # (N, ...): the target's, at each emitted position
    emitted_rows: SamplingRows  # the rows, each repeated counts[i] times


def draft_positions(rows: SamplingRows, drafts: list[list[int]]) -> SamplingRows:
    """The rows to sample: row i at each of its len(drafts[i]) + 1 positions."""
    return rows.expanded([len(d) + 1 for d in drafts])


def verify_drafts(
    sampler: Sampler,
    logits: torch.Tensor,
    meta: SamplingMetadata,
    rows: SamplingRows,
    drafts: list[list[int]],
    draft_probs: Sequence[torch.Tensor | None] = (),
) -> Verified:
    """Sample every draft position of `rows` (row i proposed drafts[i], maybe none) and keep
    what the target agrees with (module docstring). logits (T, vocab) and meta: those of
    draft_positions(rows, drafts), as for a plain step of those rows. draft_probs: row i's q
    at each of its drafts (len(drafts[i]), vocab), or None (one-hot drafts); where some row
    has one, the step verifies by rejection sampling against q (_verify_against_q)."""
    num_drafts = [len(d) for d in drafts]
    starts = list(itertools.accumulate((k + 1 for k in num_drafts), initial=0))[:-1]
    if meta.output_counts is not None:
        _count_earlier_drafts(meta.output_counts, starts, drafts)
    if any(q is not None for q in draft_probs):
        return _verify_against_q(logits, meta, rows, drafts, draft_probs, starts)
    # Seeded random rows with drafts: their generators, keyed by row, before the draws.
    seeded = {
        i: meta.generators[starts[i]]
        for i in range(len(drafts))
        if num_drafts[i] and starts[i] in meta.generators
    }
    snapshots = snapshot_generators(seeded)
    result = sampler(logits, meta)
    # the step's sync (sync scheduling): T token ids, accepted on the host
    num_accepted = accept_prefixes(result.sampled_token_ids.tolist(), drafts)
    rewind = {i: g for i, g in seeded.items() if num_accepted[i] < num_drafts[i]}
    rewind_generators(rewind, snapshots, num_accepted, logits.shape[1])
    counts = [a + 1 for a in num_accepted]
    emitted_rows = [start + j for start, count in zip(starts, counts) for j in range(count)]
    emitted = to_device(emitted_rows, torch.int64, logits.device)
    logprobs = None
    if result.logprobs is not None:
        logprobs = LogprobsTensors(*(t.index_select(0, emitted) for t in result.logprobs))
    return Verified(
        result.sampled_token_ids.index_select(0, emitted),
        counts,
        logprobs,
        rows.expanded(counts),
    )


def _verify_against_q(
    logits: torch.Tensor,
    meta: SamplingMetadata,
    rows: SamplingRows,
    drafts: list[list[int]],
    draft_probs: Sequence[torch.Tensor | None],
    starts: list[int],
) -> Verified:
    """verify_drafts for drafts sampled from the draft's q (runner/draft_sampling.py): the
    target's processed distribution p at every position (the plain sampler's own stages), then
    rejection_sample: draft x kept with min(1, p(x) / q(x)), the first rejected one replaced by
    a draw from max(0, p - q), a bonus draw from p after all were kept; a one-hot q for rows
    without one. Greedy rows keep the drafts equal to the processed argmax. A seeded row draws
    its acceptance and residual noise from its generator, after its draft's draws."""
    device = logits.device
    layout = DraftLayout.build([len(d) for d in drafts], device)
    processed, own = Sampler.process(logits, meta)
    greedy_ids = None if meta.all_random else processed.argmax(dim=-1)
    probs = Sampler.probabilities(processed, meta, own)  # (T, vocab)
    flat = [t for d in drafts for t in d]
    draft_ids = to_device(flat, torch.int64, device)
    vocab = logits.shape[1]
    q = [
        one_hot(to_device(d, torch.int64, device), vocab).float() if p is None else p
        for d, p in itertools.zip_longest(drafts, draft_probs)
        if d
    ]
    generators = {i: meta.generators[s] for i, s in enumerate(starts) if s in meta.generators}
    # some row is random (it has a q): the rows are all random, or is_greedy says which
    greedy = None if meta.is_greedy is None else meta.is_greedy.index_select(0, layout.bonus_rows)
    out = rejection_sample(
        probs,
        draft_ids,
        layout,
        generators,
        greedy,
        torch.cat(q) if q else probs.new_empty((0, vocab)),
        greedy_token_ids=greedy_ids,
    )
    counts = [a + 1 for a in out.num_accepted.tolist()]  # the step's sync, as the race's
    sampled = out.token_ids[out.token_ids != PLACEHOLDER_TOKEN_ID]  # (N,) rows in order
    emitted = [start + j for start, count in zip(starts, counts) for j in range(count)]
    logprobs = None
    if meta.max_num_logprobs is not None:
        at = logits.index_select(0, to_device(emitted, torch.int64, device))
        logprobs = compute_logprobs_for(at, sampled, meta.max_num_logprobs)
    return Verified(sampled, counts, logprobs, rows.expanded(counts))


def one_token_rows(
    request_ids: list[str], token_ids: list[list[int]], starts: list[int]
) -> tuple[list[str], list[list[int]], list[int]]:
    """Requests feeding several tokens (request i: token_ids[i] from position starts[i]) as a
    pure-decode batch: a row per token, in order, each with its request's block table and the
    sequence length up to and including that token. Attention writes every token's keys and
    values before any row reads them, so row j of a request sees its rows before j as the
    causal prefill of those tokens would; the step can then run as a decode step (compiled
    decode on CPU, CUDA graphs). Returns (request id, [token], seq_len) per row."""
    rids: list[str] = []
    rows: list[list[int]] = []
    seq_lens: list[int] = []
    for rid, tokens, start in zip(request_ids, token_ids, starts):
        for j, token in enumerate(tokens):
            rids.append(rid)
            rows.append([token])
            seq_lens.append(start + j + 1)
    return rids, rows, seq_lens


def _count_earlier_drafts(counts: torch.Tensor, starts: list[int], drafts: list[list[int]]) -> None:
    """Add to each position's output token counts (T, vocab) the drafts before it: position j
    of a row has seen drafts 0..j-1 as outputs (penalties). starts[i]: row i's first
    position."""
    rows: list[int] = []
    tokens: list[int] = []
    for start, row_drafts in zip(starts, drafts):
        for j in range(1, len(row_drafts) + 1):
            rows.extend([start + j] * j)
            tokens.extend(row_drafts[:j])
    if rows:
        device = counts.device
        index = (to_device(rows, torch.int64, device), to_device(tokens, torch.int64, device))
        counts.index_put_(index, torch.ones(len(rows), device=device), accumulate=True)


class _RowTokens(Sequence[int]):
    """A request row's prompt then outputs, as one sequence, without copying them."""

    def __init__(self, row: RequestRow) -> None:
        self.prompt, self.outputs = row.prompt_token_ids, row.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt) + len(self.outputs)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        n = len(self.prompt)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            assert step == 1
            return self.prompt[start:stop] + self.outputs[max(start - n, 0) : max(stop - n, 0)]
        i = i + len(self) if i < 0 else i
        return self.prompt[i] if i < n else self.outputs[i - n]


class DraftProposer:
    """The runner's proposer: drafts for each request that just sampled, from the proposer of
    the config's method (spec_decode/methods.py: its own tokens for ngram, a draft model's
    continuation of them for draft_model)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        draft_step: DraftStepFn | None = None,
        max_step_tokens: int = 2048,
        shares_target_kv: bool = False,
        device_type: str = "cpu",
    ) -> None:
        """draft_step: the draft model's forward (method draft_model); max_step_tokens: the
        most tokens one of its catch-up forwards takes; shares_target_kv: the draft runs on
        the target's KV cache (a self-draft, loading/draft.py); device_type: the runner's
        ("cpu", "cuda"), which resolves max_catch_up_ratio "auto"."""
        method = spec_method(config)
        ratio = config.catch_up_ratio(device_type)
        context = ProposerContext(draft_step, max_step_tokens, shares_target_kv, ratio)
        self.proposer: Proposer = method.build(config, context)
        self.max_model_len = max_model_len
        self.max_batch = config.disable_by_batch_size
        self.wait_first_token = method.waits_for_first_token(shares_target_kv)

    def propose(self, batch: InputBatch, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """Drafts for the next step of each request in `sampled` still in the batch (its new
        tokens already recorded), at most what fits before max_tokens and max_model_len with
        the target's token after them; none while the batch holds more than
        disable_by_batch_size requests, nor (a draft with its own cache) after a request's
        first token."""
        if self.max_batch is not None and len(batch.rows) > self.max_batch:
            return {}
        requests: list[tuple[str, Sequence[int], int]] = []
        for rid in sampled:
            row = batch.rows.get(rid)
            if row is None or (self.wait_first_token and len(row.output_token_ids) == 1):
                continue
            num_tokens = len(row.prompt_token_ids) + len(row.output_token_ids)
            max_tokens = row.params.max_tokens
            room = self.max_model_len - num_tokens
            if max_tokens is not None:
                room = min(room, max_tokens - len(row.output_token_ids))
            requests.append((rid, _RowTokens(row), room - 1))
        proposals = self.proposer.propose(requests)
        return {rid: d for (rid, _, _), d in zip(requests, proposals) if d}

    def record(self, drafts: list[list[int]], rows: SamplingRows, counts: list[int]) -> None:
        """Each row's verification outcome, for its backoff."""
        for rid, row_drafts, count in zip(rows.row_ids, drafts, counts):
            if row_drafts:
                self.proposer.record(rid, len(row_drafts), count - 1)

    def remove(self, request_id: str) -> None:
        self.proposer.remove(request_id)
