"""How one step picks its tokens: the Sampler over per-row sampling tensors.

The Sampler works on R rows (one per request that samples this step) in this order:

    raw logits -> logprobs (always from the raw logits, like vLLM's default)
    raw logits -> banned tokens (min_tokens) -> penalties -> greedy rows: argmax
                                             -> temperature -> top_k -> top_p -> min_p
                                             -> random rows: exponential race

The exponential race picks argmax(p_i / E_i) with E_i ~ Exponential(1), which draws i with
probability p_i. A seeded row draws its E from its own generator, so its tokens do not depend on
the batch it shares a step with nor on its row position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from pagoda.runner.device import to_device
from pagoda.runner.input_batch import BatchColumns, InputBatch, SamplingRows
from pagoda.sampling_params import SAMPLING_EPS, SamplingParams, SamplingType


class LogprobsTensors(NamedTuple):
    """Logprobs for N positions: column 0 is the chosen token, columns 1..k the top-k."""

    token_ids: torch.Tensor  # (N, k + 1) int64
    logprobs: torch.Tensor  # (N, k + 1) float32
    ranks: torch.Tensor  # (N,) int64, 1-based rank of the chosen token

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        return self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # (R,) int64
    logprobs: LogprobsTensors | None


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for R rows; tensors live on the logits' device.

    A tensor is None when no row needs it, which is what the fast paths test: a batch that is
    all greedy, without penalties, banned tokens or logprobs, costs one argmax.
    """

    temperature: torch.Tensor | None  # (R,) float32; None when all rows are greedy
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # (R,) int64, vocab_size where disabled
    top_p: torch.Tensor | None  # (R,) float32, 1.0 where disabled
    min_p: torch.Tensor | None  # (R,) float32, 0.0 where disabled
    presence_penalties: torch.Tensor | None  # (R,) float32; None for no_penalties
    frequency_penalties: torch.Tensor | None  # (R,) float32
    repetition_penalties: torch.Tensor | None  # (R,) float32
    generators: dict[int, torch.Generator]  # row -> generator, random seeded rows only
    output_token_ids: list[list[int]]
    prompt_token_ids: list[list[int]]
    banned_token_ids: list[list[int]]  # masked to -inf (min_tokens not yet reached)
    max_num_logprobs: int | None
    logit_bias: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # per row
    max_top_k: int = 0  # the largest enabled top_k (computed on the host: no device sync)
    # Output tokens missing from output_token_ids because the step sampling them is still in
    # flight (async scheduling): rows (K,) and token ids (K,) on the device. Penalties only.
    pending_output_rows: torch.Tensor | None = None
    pending_output_tokens: torch.Tensor | None = None
    # The persistent batch's penalty state instead of the lists: (R, vocab) output token
    # counts (float32) and prompt tokens seen (bool), on the device.
    output_counts: torch.Tensor | None = None
    prompt_seen: torch.Tensor | None = None

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalties is None

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @classmethod
    def from_rows(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        generators: dict[int, torch.Generator],
        banned_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        all_greedy, all_random = all(greedy), bool(params) and not any(greedy)
        random_rows = [p for p, g in zip(params, greedy) if not g]

        device = torch.device(device)

        def column(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device)

        temperature = top_k = top_p = min_p = None
        max_top_k = 0
        if not all_greedy:
            temperature = column([p.temperature for p in params], torch.float32)
            if any(0 < p.top_k < vocab_size for p in random_rows):
                ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
                top_k = column(ks, torch.int64)
                max_top_k = max(k for k in ks if k < vocab_size)
            if any(p.top_p < 1.0 for p in random_rows):
                top_p = column([p.top_p for p in params], torch.float32)
            if any(p.min_p > 0.0 for p in random_rows):
                min_p = column([p.min_p for p in params], torch.float32)

        presence = frequency = repetition = None
        if any(
            p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
            for p in params
        ):
            presence = column([p.presence_penalty for p in params], torch.float32)
            frequency = column([p.frequency_penalty for p in params], torch.float32)
            repetition = column([p.repetition_penalty for p in params], torch.float32)

        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=temperature,
            all_greedy=all_greedy,
            all_random=all_random,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            presence_penalties=presence,
            frequency_penalties=frequency,
            repetition_penalties=repetition,
            generators={row: g for row, g in generators.items() if not greedy[row]},
            output_token_ids=output_token_ids,
            prompt_token_ids=prompt_token_ids,
            banned_token_ids=banned_token_ids,
            max_num_logprobs=max(logprobs) if logprobs else None,
            logit_bias=[p.logit_bias for p in params] if any(p.logit_bias for p in params) else [],
            max_top_k=max_top_k,
        )

    @classmethod
    def from_batch(
        cls,
        columns: BatchColumns,
        batch: InputBatch,
        rows: SamplingRows,
        generators: dict[int, torch.Generator],
        eos_token_ids: Sequence[int],
    ) -> SamplingMetadata:
        """The step's metadata: the rows' columns (built once while the rows stay the same),
        plus what changes every step: min_tokens bans, penalty counts, generators. The same
        values as from_rows would build from the rows' SamplingParams and token lists."""
        banned: list[list[int]] = [[] for _ in rows.row_ids]
        if columns.min_tokens is not None:
            outputs = np.asarray(rows.num_outputs, np.int64)
            for i in np.flatnonzero(columns.min_tokens > outputs).tolist():
                banned[i] = [*eos_token_ids, *rows.leaders[i].params.stop_token_ids]
        output_counts = prompt_seen = None
        if columns.slots_t is not None:
            assert batch.output_counts is not None and batch.prompt_seen is not None
            output_counts = batch.output_counts.index_select(0, columns.slots_t)
            if columns.own is not None:  # siblings sampling their first token count nothing
                output_counts *= columns.own.unsqueeze(1)
            prompt_seen = batch.prompt_seen.index_select(0, columns.slots_t)
        return cls(
            temperature=columns.temperature,
            all_greedy=columns.all_greedy,
            all_random=columns.all_random,
            top_k=columns.top_k,
            top_p=columns.top_p,
            min_p=columns.min_p,
            presence_penalties=columns.presence,
            frequency_penalties=columns.frequency,
            repetition_penalties=columns.repetition,
            generators={row: g for row, g in generators.items() if not columns.greedy[row]},
            output_token_ids=[],
            prompt_token_ids=[],
            banned_token_ids=banned,
            max_num_logprobs=columns.max_num_logprobs,
            logit_bias=columns.logit_bias,
            max_top_k=columns.max_top_k,
            output_counts=output_counts,
            prompt_seen=prompt_seen,
        )


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return to_device([r + [pad] * (width - len(r)) for r in rows], torch.int64, device)


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(R, vocab) float32: how often each token occurs in each row."""
    ids = _padded(rows, vocab_size, device)  # pad lands in an extra column, dropped below
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_logit_bias(
    logits: torch.Tensor, logit_bias: list[tuple[tuple[int, float], ...]]
) -> torch.Tensor:
    """Add each row's (token id, bias) pairs to its logits (out of place)."""
    rows = [r for r, pairs in enumerate(logit_bias) for _ in pairs]
    cols = [t for pairs in logit_bias for t, _ in pairs]
    values = [b for pairs in logit_bias for _, b in pairs]
    index = (
        to_device(rows, torch.int64, logits.device),
        to_device(cols, torch.int64, logits.device),
    )
    bias = to_device(values, logits.dtype, logits.device)
    return logits.index_put(index, bias, accumulate=True)


def apply_banned_tokens(logits: torch.Tensor, banned_token_ids: list[list[int]]) -> torch.Tensor:
    """Set the banned tokens of each row to -inf (out of place)."""
    rows = [r for r, ids in enumerate(banned_token_ids) for _ in ids]
    if not rows:
        return logits
    cols = [t for ids in banned_token_ids for t in ids]
    index = (
        to_device(rows, torch.int64, logits.device),
        to_device(cols, torch.int64, logits.device),
    )
    return logits.index_put(index, logits.new_full((), float("-inf")))


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
    pending_output_rows: torch.Tensor | None = None,
    pending_output_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Repetition (HF/vLLM), then frequency and presence (OpenAI/vLLM) penalties (out of place).

    repetition: a token seen in the prompt or the output has a positive logit divided by the
        penalty and a negative one multiplied by it.
    frequency, presence: logit -= frequency * count_in_output + presence * (count_in_output > 0).
    The output of row pending_output_rows[j] also holds the device token pending_output_tokens[j].
    """
    num_rows, vocab_size = logits.shape
    out_counts = _token_counts(output_token_ids, vocab_size, logits.device)
    if pending_output_rows is not None and pending_output_tokens is not None:
        index = (pending_output_rows, pending_output_tokens)
        out_counts.index_put_(index, out_counts.new_ones(()), accumulate=True)
    prompt_seen = _token_counts(prompt_token_ids, vocab_size, logits.device) > 0
    return apply_penalty_counts(
        logits,
        prompt_seen,
        out_counts,
        presence_penalties,
        frequency_penalties,
        repetition_penalties,
    )


def apply_penalty_counts(
    logits: torch.Tensor,
    prompt_seen: torch.Tensor,
    out_counts: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """apply_penalties over (R, vocab) prompt_seen (bool) and out_counts (float32)."""
    seen = prompt_seen | (out_counts > 0)
    rep = repetition_penalties.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency_penalties.unsqueeze(1) * out_counts
    return logits - presence_penalties.unsqueeze(1) * (out_counts > 0).to(logits.dtype)


def apply_top_k(
    logits: torch.Tensor, top_k: torch.Tensor, max_k: int | None = None
) -> torch.Tensor:
    """Keep the k largest logits of each row (ties with the k-th kept); k >= vocab keeps all.
    max_k: the largest enabled k, when the caller knows it (reading it off top_k syncs)."""
    vocab_size = logits.shape[-1]
    enabled = top_k < vocab_size
    if max_k is None:
        max_k = int(torch.where(enabled, top_k, 1).max())
    top_values = logits.topk(max_k, dim=-1).values  # (R, max_k), descending
    kth = top_values.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))
    kth = torch.where(enabled.unsqueeze(1), kth, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p.

    A token is kept when the probability of the tokens ranked before it is < top_p, so the
    most likely token always survives; rows with top_p = 1 keep everything.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exponential race: argmax(probs / E), E ~ Exponential(1) per entry; (R,) int64.

    E is drawn as -log(U), U ~ Uniform[0, 1) (on CPU several times faster than exponential_).
    A row in `generators` draws its noise from its own generator only; other rows share the
    default generator.
    """
    uniform = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        uniform.uniform_()
    for row, generator in generators.items():
        uniform[row].uniform_(generator=generator)
    noise = uniform.log_().neg_()  # U == 0 gives E == inf: that entry cannot win
    return (probs / noise).argmax(dim=-1)


def compute_logprobs_for(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprob and 1-based rank of `token_ids` (N,), on the logits' device, under `logits`
    (N, vocab), plus the top-k."""
    logprobs = logits.float().log_softmax(dim=-1)
    token_ids = token_ids.long()
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # (N, 1)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    ids = token_ids.unsqueeze(1)
    if num_logprobs > 0:
        top = logprobs.topk(num_logprobs, dim=-1)
        chosen = torch.cat([chosen, top.values], dim=1)
        ids = torch.cat([ids, top.indices], dim=1)
    return LogprobsTensors(ids, chosen, ranks)


class Sampler:
    """Picks one token per row from (R, vocab) float32 logits; see the module docstring."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw_logits = logits
        logits = logits.float()
        if meta.logit_bias:
            logits = apply_logit_bias(logits, meta.logit_bias)
        if any(meta.banned_token_ids):
            logits = apply_banned_tokens(logits, meta.banned_token_ids)
        if meta.repetition_penalties is not None:
            assert meta.presence_penalties is not None and meta.frequency_penalties is not None
            if meta.output_counts is not None and meta.prompt_seen is not None:
                logits = apply_penalty_counts(
                    logits,
                    meta.prompt_seen,
                    meta.output_counts,
                    meta.presence_penalties,
                    meta.frequency_penalties,
                    meta.repetition_penalties,
                )
            else:
                logits = apply_penalties(
                    logits,
                    meta.prompt_token_ids,
                    meta.output_token_ids,
                    meta.presence_penalties,
                    meta.frequency_penalties,
                    meta.repetition_penalties,
                    meta.pending_output_rows,
                    meta.pending_output_tokens,
                )
        sampled = self.sample(logits, meta)
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = compute_logprobs_for(raw_logits, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled, logprobs)

    @staticmethod
    def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Greedy and random rows of already penalized logits -> (R,) int64 token ids."""
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            assert greedy is not None
            return greedy
        temperature = meta.temperature
        assert temperature is not None
        is_greedy = temperature < SAMPLING_EPS
        logits = logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(1)
        if meta.top_k is not None:
            logits = apply_top_k(logits, meta.top_k, meta.max_top_k or None)
        if meta.top_p is not None:
            logits = apply_top_p(logits, meta.top_p)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        sampled = random_sample(logits.softmax(dim=-1), meta.generators)
        if greedy is None:
            return sampled
        return torch.where(is_greedy, greedy, sampled)

    compute_logprobs_for = staticmethod(compute_logprobs_for)
