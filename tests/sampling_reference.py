"""The sampler's inputs built the plain way, as the tests' reference: SamplingMetadata from a list
of SamplingParams and token lists (the runner builds it from the persistent batch's columns and
device counts: SamplingMetadata.from_batch), and the penalties from token lists."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagoda.runner.sampler import SamplingMetadata, apply_penalty_counts
from pagoda.sampling_params import SamplingParams, SamplingType


def token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(R, vocab) float32: how often each token occurs in each row."""
    width = max((len(r) for r in rows), default=0)
    padded = [r + [vocab_size] * (width - len(r)) for r in rows]  # pad: a column dropped below
    ids = torch.tensor(padded, dtype=torch.int64, device=device).view(len(rows), width)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    presence: torch.Tensor | None,
    frequency: torch.Tensor | None,
    repetition: torch.Tensor | None,
) -> torch.Tensor:
    """apply_penalty_counts with each row's counts taken from its prompt and output lists."""
    vocab, device = logits.shape[1], logits.device
    seen = token_counts(prompt_token_ids, vocab, device) > 0
    counts = token_counts(output_token_ids, vocab, device)
    return apply_penalty_counts(logits, seen, counts, presence, frequency, repetition)


def metadata_from_rows(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    prompt_token_ids: list[list[int]],
    generators: dict[int, torch.Generator],
    banned_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device | str,
) -> SamplingMetadata:
    """Every row's SamplingParams as the sampler's tensors, a disabled stage None where no row
    uses it (top_k >= vocab is disabled)."""
    device = torch.device(device)
    greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
    random_rows = [p for p, g in zip(params, greedy) if not g]

    def column(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(list(values), dtype=dtype, device=device)

    def penalty(values: list[float], neutral: float) -> torch.Tensor | None:
        return column(values, torch.float32) if any(v != neutral for v in values) else None

    temperature = top_k = top_p = min_p = None
    max_top_k = 0
    if not all(greedy):
        temperature = column([p.temperature for p in params], torch.float32)
        if any(0 < p.top_k < vocab_size for p in random_rows):
            ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
            top_k = column(ks, torch.int64)
            max_top_k = max(k for k in ks if k < vocab_size)
        if any(p.top_p < 1.0 for p in random_rows):
            top_p = column([p.top_p for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in random_rows):
            min_p = column([p.min_p for p in params], torch.float32)
    presence = penalty([p.presence_penalty for p in params], 0.0)
    frequency = penalty([p.frequency_penalty for p in params], 0.0)
    repetition = penalty([p.repetition_penalty for p in params], 1.0)
    counts = seen = None
    if presence is not None or frequency is not None or repetition is not None:
        counts = token_counts(output_token_ids, vocab_size, device)
        seen = token_counts(prompt_token_ids, vocab_size, device) > 0
    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=all(greedy),
        all_random=bool(params) and not any(greedy),
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        presence_penalties=presence,
        frequency_penalties=frequency,
        repetition_penalties=repetition,
        generators={row: g for row, g in generators.items() if not greedy[row]},
        banned_token_ids=banned_token_ids,
        max_num_logprobs=max(logprobs) if logprobs else None,
        logit_bias=[p.logit_bias for p in params] if any(p.logit_bias for p in params) else [],
        max_top_k=max_top_k,
        output_counts=counts,
        prompt_seen=seen,
    )
