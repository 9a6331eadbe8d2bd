"""Paged attention over the flat batch. Backend `torch`: the reference every kernel is tested against.

Contract: `Attention.forward(q, k, v)` takes the projected, rotated q/k/v of all tokens in the flat
batch, writes k/v to this layer's paged cache at `slot_mapping`, then attends each query to its
request's keys [0, position] read back from the cache. Any mix of chunked prefills and decodes is
allowed in one batch (see forward_context.py for the layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.forward_context import AttentionMetadata, get_forward_context


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, layer_idx: int
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_idx = layer_idx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (num_tokens, num_heads * head_dim); k, v: (num_tokens, num_kv_heads * head_dim)
        ctx = get_forward_context()
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        meta = ctx.attn_metadata
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention_torch(q, k_cache, v_cache, meta, self.scale)
        return out.view(num_tokens, self.num_heads * self.head_dim)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # k, v: (num_tokens, num_kv_heads, head_dim); caches: (num_blocks, block_size, kv_heads, head_dim)
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """(num_blocks, block_size, kv_heads, head_dim)[ids] -> (*ids.shape[:-1], n * block_size, ...)."""
    out = cache.index_select(0, block_ids.reshape(-1))
    return out.view(*block_ids.shape[:-1], -1, *cache.shape[2:])


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Reference paged attention. q: (num_tokens, num_heads, head_dim) -> same shape."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[2]
    if meta.num_decodes:
        qd = q.index_select(0, meta.decode_token_idx).unsqueeze(2)  # (B, H, 1, D)
        tables = meta.decode_block_tables
        kd = _gather_blocks(k_cache, tables).transpose(1, 2).to(q.dtype)  # (B, Hkv, L, D)
        vd = _gather_blocks(v_cache, tables).transpose(1, 2).to(q.dtype)
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        )
        out.index_copy_(0, meta.decode_token_idx, od.squeeze(2))
    for p in meta.prefills:
        qp = q[p.token_start : p.token_end].transpose(0, 1)  # (H, q_len, D)
        kp = _gather_blocks(k_cache, p.block_ids)[: p.seq_len].transpose(0, 1).to(q.dtype)
        vp = _gather_blocks(v_cache, p.block_ids)[: p.seq_len].transpose(0, 1).to(q.dtype)
        op = F.scaled_dot_product_attention(
            qp,
            kp,
            vp,
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[p.token_start : p.token_end] = op.transpose(0, 1)
    return out
