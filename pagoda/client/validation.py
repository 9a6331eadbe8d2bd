"""A request's checks, done once, at the client edge (LLM and the async client): what the
engine would otherwise find out by failing. The engine trusts what passes (EngineCore.add_request
checks only that a request id is not in use, which only it knows).

SamplingParams has already checked each field on its own (sampling_params.py); here they are
checked against the engine: its vocabulary, context length, KV pool and max_num_seqs. The
grammar of structured outputs is checked by engine/grammar.py's check_structured_outputs, which
the clients call (off the event loop for the async one: a large schema takes a while).
"""

from __future__ import annotations

from typing import Any

from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.messages import EngineInfo


def check_request(
    info: EngineInfo,
    max_num_seqs: int,
    prompt_token_ids: list[int],
    params: SamplingParams,
    kv_transfer_params: dict[str, Any] | None = None,
    pooling: bool = False,
) -> None:
    """ValueError, in the words an OpenAI client gets as a 400, unless the engine can run it.
    A pooling request (--runner pooling) computes its prompt only: it may fill the context."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty: give at least one token")
    vocab = info.vocab_size
    if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
    if pooling:
        if len(prompt_token_ids) > info.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {info.max_model_len} tokens. However, "
                f"your input has {len(prompt_token_ids)} tokens; shorten it or pass "
                "truncate_prompt_tokens."
            )
        _check_fits_pool(info, len(prompt_token_ids), 0, 1)
        return
    for field, ids in params.token_id_fields().items():
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise ValueError(f"{field} must be token ids in [0, {vocab}), got {bad}")
    if params.n > max_num_seqs:
        raise ValueError(f"n={params.n} exceeds max_num_seqs={max_num_seqs}")
    if params.structured_outputs is not None and kv_transfer_params:
        raise ValueError("structured outputs do not combine with kv_transfer_params")
    max_tokens = resolved_max_tokens(info, len(prompt_token_ids), params.max_tokens)
    _check_fits_pool(info, len(prompt_token_ids), max_tokens, params.n)


def resolved_max_tokens(info: EngineInfo, prompt_len: int, max_tokens: int | None) -> int:
    """max_tokens, None meaning up to the context length; ValueError past it."""
    limit = info.max_model_len
    if prompt_len >= limit:
        raise ValueError(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"has {prompt_len} tokens; leave room for at least one output token."
        )
    if max_tokens is None:
        return limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise ValueError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in "
            "the completion). Please reduce the prompt or max_tokens."
        )
    return max_tokens


def _check_fits_pool(info: EngineInfo, prompt_len: int, max_tokens: int, n: int) -> None:
    # n samples share the prompt's full blocks; each needs its own tail blocks.
    shared = prompt_len // info.block_size
    per_sample = -(-(prompt_len + max_tokens) // info.block_size) - shared
    needed = shared + n * per_sample
    if needed > info.num_blocks:
        raise ValueError(
            f"the request needs up to {needed} KV blocks ({prompt_len} prompt tokens + "
            f"{max_tokens} max tokens, n={n}) but the whole cache has {info.num_blocks}; "
            "lower max_tokens or raise --kv-cache-memory-bytes"
        )
