"""Per-step attention metadata, visible to every attention layer through one scoped context.

The model runner builds one `AttentionMetadata` per step and runs the forward pass inside
`forward_context(...)`; attention layers read it with `get_forward_context()`, unless the forward
is handed the context as an argument (compiled decode steps: dynamo cannot trace the context
variable). Nothing here is a bare module global: the context variable is set and reset around
each forward.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagoda.kernels.paged_cache import KVCache
    from pagoda.layers.context_parallel import ContextParallelMetadata

# One KVCache per layer.
KVCaches = Sequence["KVCache"]


@dataclass
class PrefillSeq:
    """A request with more than one query token this step: flat rows [token_start, token_end)."""

    token_start: int
    token_end: int
    seq_len: int


@dataclass
class AttentionMetadata:
    """Index tensors of one step. Decode rows (one query token) and prefill rows (more) are
    listed apart, so each backend runs one batched call per kind. Block tables may be views
    of wider persistent buffers (row stride > width); rows cover positions [0, seq_len).

    Padding (CUDA-graph decode batches padded to a captured size): slot -1 (nothing written)
    and decode seq_len 0 (nothing read; the backends write zeros)."""

    num_tokens: int
    query_lens: list[int]
    seq_lens: list[int]
    slot_mapping: torch.Tensor  # (num_tokens,) int64 flat slot each new key/value is written to
    decode_token_idx: torch.Tensor  # (num_decodes,) int64 token index in the flat batch
    decode_seq_lens: torch.Tensor  # (num_decodes,) int32
    decode_block_tables: torch.Tensor  # (num_decodes, max_blocks) int32
    prefill_token_start: torch.Tensor  # (num_prefills,) int32 first flat row of each prefill
    prefill_query_lens: torch.Tensor  # (num_prefills,) int32
    prefill_seq_lens: torch.Tensor  # (num_prefills,) int32
    prefill_block_tables: torch.Tensor  # (num_prefills, max_blocks) int32
    prefills: list[PrefillSeq]
    max_prefill_query_len: int
    # Every request in flat-batch order, for kernels that take decodes and prefills in one call
    # (the CPU kernels' paged_attention). Filled in steps with a prefill only; empty otherwise.
    query_start_loc: torch.Tensor  # (num_reqs + 1,) int32 first flat row of each request, then
    # num_tokens
    req_seq_lens: torch.Tensor  # (num_reqs,) int32
    req_block_tables: torch.Tensor  # (num_reqs, max_blocks) int32
    # Split-K factor of the triton decode kernel; a function of static sizes only, so a
    # captured graph and an eager step of the same batch size compute identically.
    decode_num_splits: int = 1
    # (num_decodes, 1, 1, max_blocks * block_size) additive mask (0 = attend, -inf = not):
    # built by the torch backend's first layer of a step and reused by the others.
    decode_mask: torch.Tensor | None = None
    # The same for sliding-window layers, one per window (key: the window).
    decode_window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # Prefill context parallelism (layers/context_parallel.py): this rank's rows and KV slots;
    # the model then runs on those rows only. None: one rank computes every row.
    context_parallel: ContextParallelMetadata | None = None

    @property
    def num_decodes(self) -> int:
        return int(self.decode_token_idx.shape[0])


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
