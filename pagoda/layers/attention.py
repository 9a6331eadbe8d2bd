"""Paged attention over the flat batch. Backend `torch`: the reference every kernel is tested against.

Contract: `Attention.forward(q, k, v)` takes the projected, rotated q/k/v of all tokens in the flat
batch, writes k/v to this layer's paged cache at `slot_mapping`, then attends each query to its
request's keys [0, position] read back from the cache. Any mix of chunked prefills and decodes is
allowed in one batch (see forward_context.py for the layout). Backend `triton` (the GPU default)
runs the kernels of pagoda/kernels/ over the same cache and metadata.

Sliding window (`sliding_window=W`, Mistral / Gemma 3's local layers, as in HF transformers):
the query at position p attends to keys [max(0, p - W + 1), p] only, its last W positions, in
every backend; None (or 0): the full causal attention above. The cache still holds every
position (the window is a mask over the reads).

Under prefill context parallelism (metadata.context_parallel set) a rank's cache holds every
N-th position of each request, and layers/context_parallel.py attends across the ranks (full
attention only: a sliding-window layer raises there).

A quantized cache (`--kv-cache-dtype int8|fp8`) is quantized here on write; the torch path
dequantizes it here on read, to the query dtype, before attention; pagoda's CPU attention (below)
converts its rows to float32 (code * scale, computed in float32 as dequantize_kv computes it
before the cast to the query dtype).

On CPU, where pagoda's C++ kernels are built (pagoda/kernels/cpu; `cpu_kernel`, set by the model
runner), every step reads the keys and values from the cache as stored (float32 in place;
bfloat16, float16, int8 and fp8 converted to float32 a chunk of positions at a time, the values
read_kv gives in float32) with
`paged_decode_attention` (pure decode) or `paged_attention` (with prefill chunks) instead, which
reduce each query row the same way whatever the rows beside it: a position gets the same bits
alone, batched, chunked, after a prefix-cache hit or as a verification row, so the int8
rounding of the next matmul's input sees the same value (docs/determinism.md).
paged_attention_torch stays the reference they are tested against.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels.paged_cache import KVCache
from pagoda.layers.context_parallel import context_parallel_attention
from pagoda.layers.forward_context import AttentionMetadata, ForwardContext, get_forward_context
from pagoda.layers.kv_cache import read_kv, write_kv_cache

# The cache dtypes paged_attention.cpp reads (int8 and fp8 with their scales).
CPU_KERNEL_KV_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.float8_e4m3fn,
)


class Attention(nn.Module):
    backend = "torch"  # or "triton" (pagoda/kernels), set by the model runner
    cpu_kernel = False  # torch backend on CPU with pagoda's C++ kernels built; set likewise

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        layer_idx: int,
        *,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0
        if sliding_window is not None and sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0 or None: full), got {sliding_window}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_idx = layer_idx
        # keys [p - W + 1, p] for the query at position p; None: full causal attention
        self.sliding_window = sliding_window or None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """Triton backend only: rotary, the (cos, sin) of `RotaryEmbedding.cos_sin` when q and k
        are not rotated yet, and qk_norm, (q weight, k weight, eps) of a per-head RMSNorm still
        to apply before the rotation; both are fused into the KV-cache write."""
        # q: (num_tokens, num_heads * head_dim); k, v: (num_tokens, num_kv_heads * head_dim)
        assert self.backend == "triton" or (rotary is None and qk_norm is None)
        assert qk_norm is None or rotary is not None
        if ctx is None:
            ctx = get_forward_context()
        cache = ctx.kv_caches[self.layer_idx]
        meta = ctx.attn_metadata
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        window = self.sliding_window or 0
        if meta.context_parallel is not None:
            if window:
                raise ValueError(
                    "sliding-window attention is not supported with prefill context parallelism "
                    f"(layer {self.layer_idx}: sliding_window={window}); run without "
                    "--prefill-context-parallel-size"
                )
            out = context_parallel_attention(
                q,
                k,
                v,
                cache,
                meta.context_parallel,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                self.scale,
            )
        elif self.backend == "triton":
            out = paged_attention_triton(
                q, k, v, cache, meta, self.scale, rotary, qk_norm, window=window
            )
        else:
            write_kv_cache(k, v, cache, meta.slot_mapping)
            if self.cpu_kernel and cache.k.dtype in CPU_KERNEL_KV_DTYPES:
                out = cpu_paged_attention(q, cache, meta, self.scale, window)
            else:
                out = paged_attention_torch(q, cache, meta, self.scale, window)
        return out.view(num_tokens, self.num_heads * self.head_dim)


def cpu_paged_attention(
    q: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    value_dim: int = 0,
    ops: Any = None,
) -> torch.Tensor:
    """pagoda's C++ attention over a cache of a CPU_KERNEL_KV_DTYPES dtype, read as stored (the
    module docstring): a pure decode step by paged_decode_attention, any other by
    paged_attention, the same per-row reduction over prefill chunks and decodes alike.
    value_dim > 0: a latent cache whose values are each row's first value_dim
    (layers/latent_attention.py). ops: the kernels' namespace, torch.ops.pagoda_cpu unless an
    A/B benchmark passes another build's (benchmarks/attention_ab.py)."""
    ops = torch.ops.pagoda_cpu if ops is None else ops
    k_scale, v_scale = cache.k_scale, cache.v_scale  # a latent cache's values take k_scale
    if meta.num_decodes == q.shape[0]:
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        return ops.paged_decode_attention(
            q, cache.k, cache.v, tables, lens, scale, window, 2, value_dim, k_scale, v_scale
        )
    tables, starts, lens = meta.req_block_tables, meta.query_start_loc, meta.req_seq_lens
    return ops.paged_attention(
        q, cache.k, cache.v, tables, starts, lens, scale, window, 2, value_dim, k_scale, v_scale
    )


def paged_attention_torch(
    q: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Reference paged attention. q: (num_tokens, num_heads, head_dim) -> same shape; window:
    the sliding window (keys [p - window + 1, p] for position p), None or 0 for full attention.
    Traced by torch.compile (compiled CPU decode steps), decode rows take
    decode_attention_reductions instead of SDPA."""
    gqa = q.shape[1] != cache.k.shape[2]
    pure_decode = meta.num_decodes == q.shape[0]
    out = q if pure_decode else torch.empty_like(q)  # pure decode: replaced below
    if meta.num_decodes:
        qd = q if pure_decode else q.index_select(0, meta.decode_token_idx)
        if torch.compiler.is_compiling():
            od = decode_attention_reductions(
                qd, cache, meta.decode_block_tables, meta.decode_seq_lens, scale, window
            )
        else:
            od = _decode_attention_sdpa(qd, cache, meta, scale, gqa, window)
        if pure_decode:
            return od
        out.index_copy_(0, meta.decode_token_idx, od)
    return _prefill_attention_torch(q, out, cache, meta, scale, gqa, window)


def _decode_attention_sdpa(
    qd: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    gqa: bool,
    window: int | None = None,
) -> torch.Tensor:
    """The decode rows qd (num_decodes, H, D) -> (num_decodes, H, D), by SDPA over the
    gathered keys and values with an additive mask (built once a step per window, kept on
    meta)."""
    kd, vd = read_kv(cache, meta.decode_block_tables, qd.dtype)  # (B, L, Hkv, D)
    if not window:
        if meta.decode_mask is None:
            meta.decode_mask = decode_mask(meta.decode_seq_lens, kd.shape[1], qd.dtype, None)
        mask = meta.decode_mask
    elif window in meta.decode_window_masks:
        mask = meta.decode_window_masks[window]
    else:
        mask = decode_mask(meta.decode_seq_lens, kd.shape[1], qd.dtype, window)
        meta.decode_window_masks[window] = mask
    return F.scaled_dot_product_attention(
        qd.unsqueeze(2),  # (B, H, 1, D)
        kd.transpose(1, 2),  # (B, Hkv, L, D)
        vd.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=gqa,
    ).squeeze(2)


def decode_mask(
    seq_lens: torch.Tensor, num_keys: int, dtype: torch.dtype, window: int | None
) -> torch.Tensor:
    """(B, 1, 1, num_keys) additive mask of decode rows of lengths seq_lens (B,): 0 on keys
    [seq_len - window, seq_len) ([0, seq_len) without a window), -inf elsewhere."""
    key_pos = torch.arange(num_keys, device=seq_lens.device)
    valid = key_pos.unsqueeze(0) < seq_lens.unsqueeze(1)  # (B, L)
    if window:
        valid &= key_pos.unsqueeze(0) >= (seq_lens - window).unsqueeze(1)
    # additive (0 / -inf) in q's dtype: SDPA would convert a bool mask in every layer
    additive = torch.zeros(valid.shape, dtype=dtype, device=seq_lens.device)
    return additive.masked_fill_(~valid, float("-inf"))[:, None, None, :]


def _prefill_attention_torch(
    q: torch.Tensor,
    out: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    gqa: bool,
    window: int | None = None,
) -> torch.Tensor:
    """The prefill rows of paged_attention_torch, written into out (num_tokens, H, D)."""
    block_size = cache.k.shape[1]
    for i, p in enumerate(meta.prefills):
        q_len = p.token_end - p.token_start
        block_ids = meta.prefill_block_tables[i, : -(-p.seq_len // block_size)]
        # 4-D (1, H, len, D): SDPA's fused CPU kernel takes only 4-D inputs; 3-D ones fall
        # back to the math kernel, ~8x slower on a 3k-token prompt.
        qp = q[p.token_start : p.token_end].transpose(0, 1).unsqueeze(0)
        kp, vp = read_kv(cache, block_ids, q.dtype, p.seq_len)  # (seq_len, Hkv, D)
        mask: torch.Tensor | None = None
        if window and window < p.seq_len:  # the last row's window starts past position 0
            # keys from the first row's window start on; query i sees (its position - window,
            # its position]
            first = max(0, p.seq_len - q_len + 1 - window)
            kp, vp = kp[first:], vp[first:]
            q_pos = torch.arange(p.seq_len - q_len, p.seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(first, p.seq_len, device=q.device).unsqueeze(0)
            mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        elif q_len != p.seq_len:  # chunk after cached context: query i sees keys [0, its position]
            q_pos = torch.arange(p.seq_len - q_len, p.seq_len, device=q.device).unsqueeze(1)
            mask = torch.arange(p.seq_len, device=q.device).unsqueeze(0) <= q_pos
        op = F.scaled_dot_product_attention(
            qp,
            kp.transpose(0, 1).unsqueeze(0),  # (1, Hkv, seq_len, D)
            vp.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[p.token_start : p.token_end] = op[0].transpose(0, 1)
    return out


def decode_attention_reductions(
    q: torch.Tensor,
    cache: KVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention as elementwise products and sums, for torch.compile: inductor fuses
    the block gather (and dequantization) into the reductions and never materializes the
    keys and values, which SDPA needs. Eagerly this is slow (it builds (B, H, L, D) products);
    paged_attention_torch is the reference it is tested against.

    q: (B, H, D); block_tables (B, max_blocks); seq_lens (B,) -> (B, H, D) in q's dtype.
    window: keys [seq_len - window, seq_len) only; None or 0: [0, seq_len).
    """
    batch, num_heads, head_dim = q.shape
    k, v = read_kv(cache, block_tables, torch.float32)  # (B, L, Hkv, D)
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    qg = q.float().view(batch, num_kv_heads, group, 1, head_dim)
    scores = (qg * k.permute(0, 2, 1, 3).unsqueeze(2)).sum(-1) * scale  # (B, Hkv, g, L)
    key_pos = torch.arange(k.shape[1], device=q.device)
    valid = key_pos.unsqueeze(0) < seq_lens.unsqueeze(1)  # (B, L)
    if window:
        valid = valid & (key_pos.unsqueeze(0) >= (seq_lens - window).unsqueeze(1))
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = (probs.unsqueeze(-1) * v.permute(0, 2, 1, 3).unsqueeze(2)).sum(-2)  # (B, Hkv, g, D)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def paged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    window: int = 0,
) -> torch.Tensor:
    """The triton backend: write k/v by slot (padding slots skipped), normalizing (qk_norm) and
    rotating (rotary: cos, sin) q and k on the way when given, then one decode call (split-K)
    and one prefill call, each over the sliding `window` (0: full attention). Launches only; no
    host sync, so CUDA graphs capture it."""
    from pagoda.kernels import attention as kernels
    from pagoda.kernels.kv_cache import write_kv_cache as write_kv_cache_triton
    from pagoda.kernels.rotary_kv_cache import rotary_write_kv_cache

    if rotary is None:
        write_kv_cache_triton(k, v, cache, meta.slot_mapping)
    else:
        cos, sin = rotary
        rotary_write_kv_cache(q, k, v, cos, sin, cache, meta.slot_mapping, qk_norm)
    out = torch.empty_like(q)
    if meta.num_decodes:
        kernels.paged_decode_attention(
            q,
            out,
            cache,
            meta.decode_token_idx,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            scale,
            meta.decode_num_splits,
            window,
        )
    if meta.prefills:
        kernels.paged_prefill_attention(
            q,
            out,
            cache,
            meta.prefill_token_start,
            meta.prefill_query_lens,
            meta.prefill_seq_lens,
            meta.prefill_block_tables,
            meta.max_prefill_query_len,
            scale,
            window,
        )
    return out
