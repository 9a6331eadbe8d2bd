"""Attention under prefill context parallelism (vLLM's --prefill-context-parallel-size N): N ranks,
each holding the whole model, split every step's prompt tokens and shard the KV cache along the
sequence.

    KV of the token at position p:  on rank p % N only (interleaved one token at a time, vLLM's
                                    cp_kv_cache_interleave_size 1), in row (p % block_size) // N
                                    of its block: a rank's blocks hold block_size / N tokens,
                                    so each rank holds 1/N of every request's keys and values.
    rows a rank computes:           the prefill rows (requests with more than one query token
                                    this step) at its own positions, and every decode row (one
                                    query token), replicated on all ranks.

Per layer, after each rank writes the K/V of the rows it owns:
- prefill rows: each rank reads its shard of every prefilling request's keys and values
  [0, seq_len); one all-gather puts the sequences back together on every rank, and each rank
  attends its own query rows (causal by position) with SDPA.
- decode rows: each rank attends every decode query over its own shard only, giving a partial
  output and its log-sum-exp; one all-gather of those, and the partials combine into the softmax
  over the union of the shards, which is the whole sequence.
After the last layer the runner all-gathers the rows (runner/context_parallel.py), so every rank
holds the step's hidden states and samples as one process does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.kernels.paged_cache import KVCache
from pagoda.layers.kv_cache import read_kv, write_kv_cache
from pagoda.layers.parallel import ContextParallel

# A rank's prefill queries are attended in runs of this many rows, each over the keys up to its
# last position only: an explicit mask (positions interleave across ranks, so SDPA's is_causal
# does not apply) would otherwise cost the whole (queries x keys) product, twice causal's.
QUERY_BLOCK = 128


@dataclass
class ContextPrefill:
    """One prefilling request as a rank sees it: its query rows [local_start, local_end) of the
    rank's rows (contiguous, possibly none), at positions first_position + i * N, over keys
    [0, seq_len) in the logical blocks block_ids. Each rank's shard of it is shard_len rows
    long: row i of rank r's shard is position i * N + r."""

    local_start: int
    local_end: int
    first_position: int
    seq_len: int
    block_ids: torch.Tensor  # (ceil(seq_len / block_size),) int32
    shard_len: int


@dataclass
class ContextParallelMetadata:
    """A step's rows and KV slots on one context-parallel rank (built by
    runner/context_parallel.context_metadata). Decode block tables and lengths are the step's
    (AttentionMetadata.decode_*), in logical block ids, which every rank shares."""

    cp: ContextParallel
    local_rows: torch.Tensor  # (R,) int64 ascending flat rows this rank computes
    rank_rows: list[torch.Tensor]  # every rank's local rows (local_rows is this rank's)
    write_rows: torch.Tensor  # (W,) int64 local rows whose K/V this rank stores
    write_slots: torch.Tensor  # (W,) int64 their slots in this rank's cache
    decode_rows: torch.Tensor  # (num_decodes,) int64 local row of each decode query
    prefills: list[ContextPrefill]


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache,
    cpm: ContextParallelMetadata,
    decode_block_tables: torch.Tensor,
    decode_seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: (R, H, D), k, v: (R, Hkv, D) of this rank's rows -> (R, H, D). The decode block tables
    and lengths are the step's (AttentionMetadata.decode_*)."""
    write_kv_cache(k[cpm.write_rows], v[cpm.write_rows], cache, cpm.write_slots)
    out = torch.empty_like(q)
    if cpm.decode_rows.numel():
        qd = q[cpm.decode_rows]
        partial, lse = _decode_partial(
            qd, cache, decode_block_tables, decode_seq_lens, cpm.cp, scale
        )
        out[cpm.decode_rows] = combine_partials(partial, lse, cpm.cp).to(q.dtype)
    if cpm.prefills:
        _prefill_attention(q, out, cache, cpm, scale)
    return out


def _decode_partial(
    q: torch.Tensor,
    cache: KVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cp: ContextParallel,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of decode queries q (B, H, D) over this rank's shard of their keys: the
    normalized partial output (B, H, D) float32 and its log-sum-exp (B, H) (-inf where the shard
    holds none of the request's keys; that row's output is then 0)."""
    batch, num_heads, head_dim = q.shape
    k, v = read_kv(cache, block_tables, torch.float32)  # (B, M, Hkv, D)
    num_kv_heads = k.shape[2]
    qg = q.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bhgd,bmhd->bhgm", qg, k) * scale  # (B, Hkv, g, M)
    positions = torch.arange(k.shape[1], device=q.device) * cp.size + cp.rank
    valid = positions.unsqueeze(0) < seq_lens.unsqueeze(1)  # (B, M)
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, g)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)  # a row without keys: 0
    out = torch.einsum("bhgm,bmhd->bhgd", probs, v)
    return out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads)


def combine_partials(partial: torch.Tensor, lse: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The softmax attention over all ranks' shards from each rank's partial (B, H, D) and
    log-sum-exp (B, H): sum_r exp(lse_r - m) out_r / sum_r exp(lse_r - m). Every query has a key
    on some rank (its own), so the maximum m is finite."""
    packed = torch.cat([partial, lse.unsqueeze(-1)], dim=-1)  # one all-gather for both
    parts = torch.stack(cp.all_gather(packed))  # (N, B, H, D + 1)
    lses = parts[..., -1]
    weights = torch.exp(lses - lses.amax(dim=0))  # (N, B, H)
    out = (parts[..., :-1] * weights.unsqueeze(-1)).sum(dim=0)
    return out / weights.sum(dim=0).unsqueeze(-1)


def _prefill_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    cache: KVCache,
    cpm: ContextParallelMetadata,
    scale: float,
) -> None:
    """The prefill rows of context_parallel_attention, written into out."""
    cp = cpm.cp
    shards = [torch.stack(read_kv(cache, p.block_ids, q.dtype)) for p in cpm.prefills]
    gathered = torch.stack(cp.all_gather(torch.cat(shards, dim=1)))  # (N, 2, sum M, Hkv, D)
    num_kv_heads, head_dim = gathered.shape[-2:]
    offset = 0
    for p in cpm.prefills:
        kv = gathered[:, :, offset : offset + p.shard_len]  # (N, 2, M, Hkv, D)
        offset += p.shard_len
        if p.local_end == p.local_start:
            continue
        # rank r's row i is position i * N + r: interleave the shards back into positions
        kv = kv.permute(1, 2, 0, 3, 4).reshape(2, p.shard_len * cp.size, num_kv_heads, head_dim)
        kv = kv[:, : p.seq_len].transpose(1, 2)  # (2, Hkv, seq_len, D)
        for start in range(p.local_start, p.local_end, QUERY_BLOCK):
            end = min(start + QUERY_BLOCK, p.local_end)
            first = p.first_position + (start - p.local_start) * cp.size
            positions = torch.arange(first, first + (end - start) * cp.size, cp.size)
            out[start:end] = _attend(q[start:end], kv, positions.to(q.device), scale)


def _attend(
    q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Queries q (n, H, D) at ascending positions over the keys of kv (2, Hkv, seq_len, D) up
    to the last of them, each query seeing keys up to its own position -> (n, H, D)."""
    num_keys = int(positions[-1]) + 1  # a host tensor's value
    keys = torch.arange(num_keys, device=q.device)
    mask = keys.unsqueeze(0) <= positions.unsqueeze(1)  # (n, num_keys)
    qp = q.transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
    op = F.scaled_dot_product_attention(
        qp,
        kv[0, :, :num_keys].unsqueeze(0),
        kv[1, :, :num_keys].unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=qp.shape[1] != kv.shape[1],
    )
    return op[0].transpose(0, 1)
