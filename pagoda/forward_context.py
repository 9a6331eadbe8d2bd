"""Per-step attention metadata, visible to every attention layer through one scoped context.

The model runner builds one `AttentionMetadata` per step and runs the forward pass inside
`forward_context(...)`; attention layers read it with `get_forward_context()`. Nothing here is a
bare module global: the context variable is set and reset around each forward.

Flat batch layout: the tokens of all scheduled requests are concatenated, request after request.
Request i owns tokens [query_start_loc[i], query_start_loc[i+1]) of the flat batch; they sit at
positions [seq_lens[i] - query_lens[i], seq_lens[i]) of its sequence, so their keys and values
are written to the cache first and each query then attends to keys [0, its own position].

    request i:  |<------------- seq_len ------------->|
                |<-- cached (computed) -->|<- query ->|
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagoda.layers.attention import KVCache

# One KVCache per layer.
KVCaches = Sequence["KVCache"]


@dataclass
class PrefillSeq:
    """A request with more than one query token this step (torch reference backend)."""

    token_start: int
    token_end: int
    seq_len: int
    block_ids: torch.Tensor  # (num_blocks,) int64, covering positions [0, seq_len)
    mask: torch.Tensor | None  # (query_len, seq_len) bool, None when query_len == seq_len (causal)


@dataclass
class AttentionMetadata:
    num_tokens: int
    query_lens: list[int]
    seq_lens: list[int]
    slot_mapping: torch.Tensor  # (num_tokens,) int64 flat slot each new key/value is written to
    # Decode rows (one query token), batched into one padded attention call over whole blocks.
    decode_token_idx: torch.Tensor  # (num_decodes,) int64 token index in the flat batch
    decode_block_tables: torch.Tensor  # (num_decodes, max_blocks) int64, padded with block 0
    decode_mask: torch.Tensor  # (num_decodes, 1, 1, max_blocks * block_size) bool, True = attend
    prefills: list[PrefillSeq]

    @property
    def num_decodes(self) -> int:
        return int(self.decode_token_idx.numel())


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: KVCaches


_CONTEXT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "pagoda_forward_context", default=None
)


@contextlib.contextmanager
def forward_context(
    attn_metadata: AttentionMetadata, kv_caches: KVCaches
) -> Iterator[ForwardContext]:
    ctx = ForwardContext(attn_metadata, kv_caches)
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError("attention called outside forward_context(): no metadata for this step")
    return ctx


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Derive every index the torch attention backend needs, once per step.

    block_tables[i] must cover positions [0, seq_lens[i]) of request i.
    """
    assert len(query_lens) == len(seq_lens) == len(block_tables)
    slot_mapping: list[int] = []
    decode_token_idx: list[int] = []
    decode_rows: list[int] = []
    prefills: list[PrefillSeq] = []
    token_start = 0
    for i, (q_len, s_len, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
        assert 0 < q_len <= s_len and len(table) * block_size >= s_len
        slot_mapping.extend(
            table[p // block_size] * block_size + p % block_size
            for p in range(s_len - q_len, s_len)
        )
        num_blocks = -(-s_len // block_size)
        if q_len == 1:
            decode_token_idx.append(token_start)
            decode_rows.append(i)
        else:
            mask = None
            if q_len != s_len:
                q_pos = torch.arange(s_len - q_len, s_len).unsqueeze(1)
                mask = (torch.arange(s_len).unsqueeze(0) <= q_pos).to(device)
            blocks = torch.tensor(table[:num_blocks], dtype=torch.int64, device=device)
            prefills.append(PrefillSeq(token_start, token_start + q_len, s_len, blocks, mask))
        token_start += q_len

    decode_lens = torch.tensor([seq_lens[i] for i in decode_rows], dtype=torch.int64)
    max_blocks = -(-int(decode_lens.max()) // block_size) if decode_rows else 0
    tables = torch.zeros((len(decode_rows), max_blocks), dtype=torch.int64)
    for row, i in enumerate(decode_rows):
        n = min(len(block_tables[i]), max_blocks)
        tables[row, :n] = torch.tensor(block_tables[i][:n], dtype=torch.int64)
    positions = torch.arange(max_blocks * block_size)
    mask_d = positions.unsqueeze(0) < decode_lens.unsqueeze(1)
    mask_d = mask_d.view(len(decode_rows), 1, 1, max_blocks * block_size)
    return AttentionMetadata(
        num_tokens=token_start,
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        decode_token_idx=torch.tensor(decode_token_idx, dtype=torch.int64, device=device),
        decode_block_tables=tables.to(device),
        decode_mask=mask_d.to(device),
        prefills=prefills,
    )
