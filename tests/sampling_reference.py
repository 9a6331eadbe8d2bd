"""The sampler's inputs built the plain way, as the tests' reference: SamplingMetadata from a list
of SamplingParams and token lists (the runner builds it from the persistent batch's columns and
device counts: SamplingMetadata.from_batch), and the penalties from token lists."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pagoda.runner.sampler import SamplingMetadata, apply_penalty_counts
from pagoda.sampling_params import SamplingParams


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


def plain_edits(
    params: list[SamplingParams], banned_token_ids: list[list[int]]
) -> list[Callable[[torch.Tensor], None]]:
    """The params' logits edits applied the plain way, a row at a time, in the sampling table's
    order: only the allowed tokens kept, then the logit bias added, then the banned tokens
    (min_tokens' stops: given by the caller) set to -inf."""

    def apply(logits: torch.Tensor) -> None:
        for r, p in enumerate(params):
            if p.allowed_token_ids is not None:
                ids = list(p.allowed_token_ids)
                kept = logits[r, ids].clone()
                logits[r] = float("-inf")
                logits[r, ids] = kept
            for token, bias in p.logit_bias:
                logits[r, token] += bias
            for token in banned_token_ids[r]:
                logits[r, token] = float("-inf")

    wanted = any(p.allowed_token_ids is not None or p.logit_bias for p in params)
    return [apply] if wanted or any(banned_token_ids) else []


def metadata_from_rows(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    prompt_token_ids: list[list[int]],
    generators: dict[int, torch.Generator],
    banned_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device | str,
) -> SamplingMetadata:
    """Every row's SamplingParams as the sampler's tensors, a stage None where no row uses it
    (off: temperature 1 or a greedy row, top_k 0 or >= vocab, top_p 1, min_p 0)."""
    device = torch.device(device)
    greedy = [p.greedy for p in params]

    def column(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(list(values), dtype=dtype, device=device)

    def stage(values: list[float], neutral: float, dtype: torch.dtype) -> torch.Tensor | None:
        return column(values, dtype) if any(v != neutral for v in values) else None

    def random_stage(
        values: list[float], neutral: float, dtype: torch.dtype
    ) -> torch.Tensor | None:
        # a greedy row takes the argmax: its sampling stages are off
        return stage([neutral if g else v for v, g in zip(values, greedy)], neutral, dtype)

    ks = [p.top_k if p.top_k < vocab_size else 0 for p in params]
    presence = stage([p.presence_penalty for p in params], 0.0, torch.float32)
    frequency = stage([p.frequency_penalty for p in params], 0.0, torch.float32)
    repetition = stage([p.repetition_penalty for p in params], 1.0, torch.float32)
    counts = seen = None
    if presence is not None or frequency is not None or repetition is not None:
        counts = token_counts(output_token_ids, vocab_size, device)
        seen = token_counts(prompt_token_ids, vocab_size, device) > 0
    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    mixed = any(greedy) and not all(greedy)
    return SamplingMetadata(
        all_greedy=all(greedy),
        all_random=bool(params) and not any(greedy),
        is_greedy=column(greedy, torch.bool) if mixed else None,
        temperature=random_stage([p.temperature for p in params], 1.0, torch.float32),
        top_k=random_stage(ks, 0, torch.int64),
        top_p=random_stage([p.top_p for p in params], 1.0, torch.float32),
        min_p=random_stage([p.min_p for p in params], 0.0, torch.float32),
        presence_penalties=presence,
        frequency_penalties=frequency,
        repetition_penalties=repetition,
        generators={row: g for row, g in generators.items() if not greedy[row]},
        max_num_logprobs=max(logprobs) if logprobs else None,
        edits=plain_edits(params, banned_token_ids),
        max_top_k=max(ks, default=0),
        output_counts=counts,
        prompt_seen=seen,
    )
