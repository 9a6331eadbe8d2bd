"""A draft model's tokens sampled from its processed distribution q, for exact speculative
sampling at any temperature (Leviathan et al.; verification in runner/speculative.py).

A request's draft j is its output at position num_outputs + j, so it is sampled as the target
samples that position: the params' edits (logit bias, allowed tokens, min_tokens' bans at
num_outputs + j outputs), penalties counting drafts 0..j-1 as outputs, temperature, top-k,
top-p, min-p (Sampler.process and Sampler.probabilities, the target's own code), the race with
a seeded request's noise drawn from its own generator (so a seeded request reproduces). A
greedy request takes the processed argmax: a one-hot q, which verification treats as such. A
random request keeps q at each draft for its verification, which accepts draft x with
min(1, p(x) / q(x)) and on rejection draws from max(0, p - q).

A seeded request draws its drafts' noise from its generator, then its verification's
(rejection_sampler: acceptance, residual, bonus): run again in the same batch it gives the same
tokens. Unlike greedy and n-gram drafts (runner/speculative.py), not the tokens it gives without
speculation, nor always those it gives in another batch: a step's token budget may cut drafts
whose draws were made.

A request with structured outputs samples its drafts under its grammar's mask too: `grammar`
(the engine's StructuredOutputs.draft_mask, set through the executor) gives the allowed tokens
after the request's outputs and the drafts before draft j, as the target's mask at that
position will be, so q is the distribution the target's processing gives the draft's logits.
Where the grammar refuses a token already drawn (none should be) it gives no mask: such a draft
is rejected in verification whatever q is (its p is 0 there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pagoda.runner.device import to_device
from pagoda.runner.grammar_mask import apply_grammar_bitmask
from pagoda.runner.input_batch import BatchColumns, InputBatch, RequestRow, SamplingRows
from pagoda.runner.sampler import Sampler, SamplingMetadata, random_sample

# (request id, its output tokens as the runner holds them, then its drafts so far) -> the
# grammar's bitmask row after them (runner/grammar_mask.py), or None (no grammar, or refused).
DraftGrammar = Callable[[str, Sequence[int]], bytes | None]


@dataclass
class _Proposal:
    """One request's drafts of its current proposal, with q at each (None: one-hot)."""

    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor | None] = field(default_factory=list)


class DraftSampler:
    """Picks the draft model's token after each row of a draft step (DraftModelStep)."""

    def __init__(
        self,
        batch: InputBatch,
        generators: dict[str, torch.Generator],
        device: torch.device,
        eos_token_ids: Sequence[int],
    ) -> None:
        """generators: the runner's seeded generators by request id (shared with its
        sampler: a seeded request's draft and target draws come from one stream)."""
        self.batch = batch
        self.generators = generators
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self._proposals: dict[str, _Proposal] = {}
        self.grammar: DraftGrammar | None = None  # set where requests may have a grammar

    def pick(self, rows: Sequence[tuple[str, int]], logits: torch.Tensor) -> list[int]:
        """The draft's token after each row: rows[i] = (request id, the draft's sequence length
        after the row's tokens), logits (R, vocab) at that row's last token. A row that ends at
        or past its request's known tokens is a draft and is sampled; a catch-up pass that has
        not reached them yet gets the argmax, which the proposer discards."""
        tokens = logits.argmax(dim=-1)
        drafting: list[tuple[int, RequestRow, int]] = []  # (logits row, request row, draft j)
        for i, (rid, seq_len) in enumerate(rows):
            row = self.batch.rows[rid]
            j = seq_len - len(row.prompt_token_ids) - len(row.output_token_ids)
            if j >= 0:
                drafting.append((i, row, j))
        if drafting:
            index = [i for i, _, _ in drafting]
            picked = self._sample(logits[index], [(row, j) for _, row, j in drafting])
            tokens[index] = picked
        return tokens.tolist()

    def _sample(self, logits: torch.Tensor, rows: list[tuple[RequestRow, int]]) -> torch.Tensor:
        """Sample each (request row, draft j) as the target samples output num_outputs + j."""
        for row, j in rows:
            if j == 0:
                self._proposals[row.request_id] = _Proposal()
            assert len(self._proposals[row.request_id].tokens) == j, "drafts come in order"
        sampling = SamplingRows()
        for row, j in rows:
            sampling.row_ids.append(row.request_id)
            sampling.flat_rows.append(len(sampling.flat_rows))
            sampling.leaders.append(row)
            sampling.own_rows.append(row)
            sampling.indices.append(row.sample_index)
            sampling.num_outputs.append(len(row.output_token_ids) + j)
        columns = BatchColumns.gather(self.batch, sampling, self.device)
        generators = sampling.generators(self.generators, self.device)
        meta = SamplingMetadata.from_batch(
            columns, self.batch, sampling, generators, self.eos_token_ids
        )
        if meta.output_counts is not None:
            self._count_drafts(meta.output_counts, [r.request_id for r, _ in rows])
        self._mask(logits, [row for row, _ in rows])
        processed, own = Sampler.process(logits, meta)
        greedy = None if meta.all_random else processed.argmax(dim=-1)
        probs = None
        if meta.all_greedy:
            assert greedy is not None
            tokens = greedy
        else:
            probs = Sampler.probabilities(processed, meta, own)
            tokens = random_sample(probs, meta.generators)
            if greedy is not None:
                assert meta.is_greedy is not None
                tokens = torch.where(meta.is_greedy, greedy, tokens)
        for i, ((row, _), token) in enumerate(zip(rows, tokens.tolist())):
            proposal = self._proposals[row.request_id]
            proposal.tokens.append(token)
            proposal.probs.append(None if probs is None or columns.greedy[i] else probs[i])
        return tokens

    def _mask(self, logits: torch.Tensor, rows: list[RequestRow]) -> None:
        """Each grammar row's mask after its outputs and its drafts so far, on logits (R, vocab)
        in place."""
        if self.grammar is None:
            return
        masks: dict[str, list[bytes]] = {}
        for row in rows:
            tokens = [*row.output_token_ids, *self._proposals[row.request_id].tokens]
            mask = self.grammar(row.request_id, tokens)
            if mask is not None:
                masks[row.request_id] = [mask]
        apply_grammar_bitmask(logits, [row.request_id for row in rows], masks)

    def _count_drafts(self, counts: torch.Tensor, rids: list[str]) -> None:
        """Add each row's drafts so far to its output counts (R, vocab): penalties see them."""
        rows: list[int] = []
        tokens: list[int] = []
        for i, rid in enumerate(rids):
            drafted = self._proposals[rid].tokens
            rows.extend([i] * len(drafted))
            tokens.extend(drafted)
        if rows:
            index = (
                to_device(rows, torch.int64, counts.device),
                to_device(tokens, torch.int64, counts.device),
            )
            counts.index_put_(index, torch.ones(len(rows), device=counts.device), accumulate=True)

    def draft_probs(self, request_id: str, drafts: Sequence[int]) -> torch.Tensor | None:
        """q at each of `drafts` (k, vocab) float32, the request's scheduled drafts (a prefix
        of its proposal; the scheduler may cut it), taken once; None where they are one-hot
        (a greedy request) or not this sampler's."""
        proposal = self._proposals.pop(request_id, None)
        if proposal is None or proposal.tokens[: len(drafts)] != list(drafts):
            return None
        probs = proposal.probs[: len(drafts)]
        if not drafts or any(p is None for p in probs):
            return None
        return torch.stack([p for p in probs if p is not None])

    def remove(self, request_id: str) -> None:
        self._proposals.pop(request_id, None)
