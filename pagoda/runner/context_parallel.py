"""One step on a prefill-context-parallel rank (layers/context_parallel.py): which of the step's
flat rows this rank computes and where their keys and values go, the model over those rows, and
one all-gather that gives every rank the whole step's hidden states, which it then samples as one
process does (every rank samples the same tokens; the engine reads rank 0's).

A decode row is computed on every rank; the gathered hidden state of a decode row is rank 0's,
so that every rank samples from the same values.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left

import torch

from pagoda.kernels.paged_cache import KVCache
from pagoda.layers.context_parallel import ContextParallelMetadata, ContextPrefill
from pagoda.layers.forward_context import AttentionMetadata, forward_context
from pagoda.layers.parallel import ContextParallel
from pagoda.models.interface import CausalLM


def rank_rows(query_lens: list[int], seq_lens: list[int], cp: ContextParallel) -> list[list[int]]:
    """Each rank's flat rows, ascending: every decode row (one query token), and the prefill rows
    at the positions the rank owns (p % N == rank)."""
    rows: list[list[int]] = [[] for _ in range(cp.size)]
    start = 0
    for query_len, seq_len in zip(query_lens, seq_lens, strict=True):
        if query_len == 1:
            for own in rows:
                own.append(start)
        else:
            first = seq_len - query_len  # position of flat row `start`
            for r, own in enumerate(rows):
                own.extend(range(start + (r - first) % cp.size, start + query_len, cp.size))
        start += query_len
    return rows


def context_metadata(
    meta: AttentionMetadata, positions: torch.Tensor, cp: ContextParallel, block_size: int
) -> ContextParallelMetadata:
    """This rank's share of a step whose metadata (over every row, in logical slots and blocks)
    is `meta`."""
    if block_size % cp.size:
        raise ValueError(
            f"prefill_context_parallel_size={cp.size} must divide the block size ({block_size})"
        )
    device = positions.device
    all_rows = rank_rows(meta.query_lens, meta.seq_lens, cp)
    own = all_rows[cp.rank]
    rank_tensors = [torch.tensor(rows, dtype=torch.int64, device=device) for rows in all_rows]
    local_rows = rank_tensors[cp.rank]
    # K/V rows this rank stores: those at its positions, at (block, row in block // N)
    slots = meta.slot_mapping[local_rows]
    write_rows = torch.nonzero(positions[local_rows] % cp.size == cp.rank).squeeze(1)
    slots = slots[write_rows]
    offset = slots % block_size
    write_slots = slots // block_size * (block_size // cp.size) + offset // cp.size
    # own is ascending and holds every decode row: a flat row's local index is its rank in own
    decode_rows = torch.tensor(
        [bisect_left(own, row) for row in meta.decode_token_idx.tolist()],
        dtype=torch.int64,
        device=device,
    )
    prefills = []
    for i, p in enumerate(meta.prefills):
        first = p.seq_len - (p.token_end - p.token_start)  # position of the prefill's first row
        first += (cp.rank - first) % cp.size  # ... and of this rank's first row
        num_blocks = -(-p.seq_len // block_size)
        prefills.append(
            ContextPrefill(
                bisect_left(own, p.token_start),  # this rank's rows of it are contiguous
                bisect_left(own, p.token_end),
                first,
                p.seq_len,
                meta.prefill_block_tables[i, :num_blocks],
                num_blocks * (block_size // cp.size),
            )
        )
    return ContextParallelMetadata(
        cp, local_rows, rank_tensors, write_rows, write_slots, decode_rows, prefills
    )


def context_parallel_forward(
    model: CausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    kv_caches: list[KVCache],
    cp: ContextParallel,
    block_size: int,
) -> torch.Tensor:
    """The model over this rank's rows of the step, then every rank's rows gathered: the step's
    final hidden states (num_tokens, hidden_size), identical on every rank."""
    cpm = context_metadata(meta, positions, cp, block_size)
    local_meta = dataclasses.replace(meta, context_parallel=cpm)
    with forward_context(local_meta, kv_caches):
        hidden = model(input_ids[cpm.local_rows], positions[cpm.local_rows])
    return gather_rows(hidden, cpm, meta.num_tokens)


def gather_rows(
    hidden: torch.Tensor, cpm: ContextParallelMetadata, num_tokens: int
) -> torch.Tensor:
    """(num_tokens, hidden_size) from each rank's rows (R_r, hidden_size), padded to the longest
    for one all-gather. Ranks are written last to first, so rank 0's copy of a decode row wins."""
    width = max(int(rows.shape[0]) for rows in cpm.rank_rows)
    padded = hidden.new_zeros(width, hidden.shape[1])
    padded[: hidden.shape[0]] = hidden
    parts = cpm.cp.all_gather(padded)
    full = hidden.new_empty(num_tokens, hidden.shape[1])
    for rows, part in reversed(list(zip(cpm.rank_rows, parts, strict=True))):
        full[rows] = part[: rows.shape[0]]
    return full
