"""Paged multi-head latent attention (MLA, DeepSeek-V2/V3) over a latent cache, in the absorbed
form.

A token's cache row (KVCache.k: (num_blocks, block_size, 1, rank + rope); KVCache.v is empty) is
    c = [kv_a_layernorm(compressed kv) (rank values), rotated k_pe (rope values)]
(512 + 64 = 576 values for DeepSeek-V3, shared by all 128 heads). Head h's key would be
[W_UK[h] c[:rank], c[rank:]] and its value W_UV[h] c[:rank] (kv_b_proj's two halves); with the
up-projections absorbed into the query and the output (DeepSeek-V2, section 2.1.2), every head
attends over the rows themselves, as multi-query attention whose values are the keys' first
`rank` values:
    q'_h = [W_UK[h]^T q_nope_h, q_pe_h]                     (rank + rope)
    o'_h = softmax(q'_h . c * scale) c[:rank]               (rank)
    o_h  = W_UV[h] o'_h                                     (v_head_dim)
The model (models/deepseek_v3.py) forms q' and o_h; this layer writes the rows and computes o'.
Prefill chunks and decodes alike take this form: on the torch backend SDPA over the gathered
rows (the reference); on CPU with pagoda's C++ kernels paged_attention.cpp, reading the rows
as stored (any cache dtype, int8 / fp8 with their scales), each row's values its first `rank`
(`value_dim`); on the triton
backend pagoda/kernels/latent_attention.py. A quantized cache
(`--kv-cache-dtype int8|fp8`) holds each row with one scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels.paged_cache import KVCache
from pagoda.layers.attention import CPU_KERNEL_KV_DTYPES, cpu_paged_attention, decode_mask
from pagoda.layers.forward_context import AttentionMetadata, ForwardContext, get_forward_context
from pagoda.layers.kv_cache import read_kv, write_kv_cache


class LatentAttention(nn.Module):
    backend = "torch"  # or "triton" (pagoda/kernels/latent_attention.py), set by the model runner
    cpu_kernel = False  # torch backend on CPU with pagoda's C++ kernels built; set likewise

    def __init__(self, num_heads: int, kv_lora_rank: int, scale: float, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank  # the rows' latent part; the rest is the rotary key
        self.scale = scale
        self.layer_idx = layer_idx

    def forward(
        self, q: torch.Tensor, rows: torch.Tensor, ctx: ForwardContext | None = None
    ) -> torch.Tensor:
        # q: (num_tokens, num_heads, rank + rope), the absorbed queries; rows: (num_tokens,
        # rank + rope), this step's cache rows -> (num_tokens, num_heads, rank)
        if ctx is None:
            ctx = get_forward_context()
        cache = ctx.kv_caches[self.layer_idx]
        meta = ctx.attn_metadata
        if meta.context_parallel is not None:
            raise ValueError(
                "multi-head latent attention is not supported with prefill context parallelism; "
                "run without --prefill-context-parallel-size"
            )
        if self.backend == "triton":
            return self._triton(q, rows, cache, meta)
        write_kv_cache(rows.unsqueeze(1), rows[:, None, :0], cache, meta.slot_mapping)
        num_tokens = q.shape[0]
        if self.cpu_kernel and cache.k.dtype in CPU_KERNEL_KV_DTYPES:
            return cpu_paged_attention(q, cache, meta, self.scale, value_dim=self.kv_lora_rank)
        if meta.num_decodes == num_tokens:
            return self._decode(q, cache, meta)
        out = q.new_empty(num_tokens, self.num_heads, self.kv_lora_rank)
        if meta.num_decodes:
            qd = q.index_select(0, meta.decode_token_idx)
            out.index_copy_(0, meta.decode_token_idx, self._decode(qd, cache, meta))
        block_size = cache.k.shape[1]
        for i, p in enumerate(meta.prefills):
            q_len = p.token_end - p.token_start
            block_ids = meta.prefill_block_tables[i, : -(-p.seq_len // block_size)]
            keys = read_kv(cache, block_ids, q.dtype, p.seq_len)[0]  # (seq_len, 1, rank + rope)
            mask: torch.Tensor | None = None
            if q_len != p.seq_len:  # a chunk after cached context: keys [0, its position]
                q_pos = torch.arange(p.seq_len - q_len, p.seq_len, device=q.device).unsqueeze(1)
                mask = torch.arange(p.seq_len, device=q.device).unsqueeze(0) <= q_pos
            keys = keys.transpose(0, 1).unsqueeze(0)  # (1, 1, seq_len, rank + rope)
            op = F.scaled_dot_product_attention(
                q[p.token_start : p.token_end].transpose(0, 1).unsqueeze(0),  # (1, H, len, D)
                keys,
                keys[..., : self.kv_lora_rank],
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[p.token_start : p.token_end] = op[0].transpose(0, 1)
        return out

    def _triton(
        self, q: torch.Tensor, rows: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """pagoda/kernels/latent_attention.py; launches only (no host sync), as Attention's."""
        from pagoda.kernels import latent_attention as kernels
        from pagoda.kernels.kv_cache import write_kv_cache as write_kv_cache_triton

        # The key-and-value writer, handed the row as both, into the rows as both caches: the
        # same bytes (and scale) written twice, padding slots skipped.
        rows_3d = rows.unsqueeze(1)
        as_kv = KVCache(cache.k, cache.k, cache.k_scale, cache.k_scale)
        write_kv_cache_triton(rows_3d, rows_3d, as_kv, meta.slot_mapping)
        out = q.new_empty(q.shape[0], self.num_heads, self.kv_lora_rank)
        if meta.num_decodes:
            kernels.latent_decode_attention(
                q,
                out,
                cache,
                meta.decode_token_idx,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                self.scale,
                meta.decode_num_splits,
            )
        if meta.prefills:
            kernels.latent_prefill_attention(
                q,
                out,
                cache,
                meta.prefill_token_start,
                meta.prefill_query_lens,
                meta.prefill_seq_lens,
                meta.prefill_block_tables,
                meta.max_prefill_query_len,
                self.scale,
            )
        return out

    def _decode(self, qd: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """The decode rows qd (num_decodes, H, rank + rope) -> (num_decodes, H, rank)."""
        keys = read_kv(cache, meta.decode_block_tables, qd.dtype)[0]  # (B, L, 1, rank + rope)
        if meta.decode_mask is None:  # the same mask as a full-attention layer's
            meta.decode_mask = decode_mask(meta.decode_seq_lens, keys.shape[1], qd.dtype, None)
        keys = keys.transpose(1, 2)  # (B, 1, L, rank + rope)
        return F.scaled_dot_product_attention(
            qd.unsqueeze(2),  # (B, H, 1, rank + rope)
            keys,
            keys[..., : self.kv_lora_rank],
            attn_mask=meta.decode_mask,
            scale=self.scale,
            enable_gqa=True,
        ).squeeze(2)
