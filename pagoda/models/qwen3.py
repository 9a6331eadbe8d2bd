"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before rotary, explicit head_dim
(not hidden_size / num_heads) and no q/k/v bias. Everything else is llama.py's."""

from __future__ import annotations

from typing import Any

import torch

from pagoda.layers.norm import RMSNorm
from pagoda.layers.parallel import SINGLE, TensorParallel
from pagoda.models.family import ModelFamily
from pagoda.models.llama import LlamaAttention, LlamaForCausalLM

FAMILY = ModelFamily(
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    gguf_archs=("qwen3",),
    # transformers' conversion leaves head_dim at Qwen3's default (128) whatever the file says
    gguf_config_fields={"attention.key_length": "head_dim"},
)


class Qwen3Attention(LlamaAttention):
    norm_cls = RMSNorm  # of q and k per head

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        index: int | None = None,
    ) -> None:
        super().__init__(config, layer_idx, dtype, tp, index)
        self.q_norm = self.norm_cls(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = self.norm_cls(self.head_dim, config.rms_norm_eps, dtype)

    def qk_transform(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = q.shape[0]
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        return q.view(num_tokens, self.q_size), k.view(num_tokens, self.kv_size)

    def qk_norm_weights(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        assert self.q_norm.eps == self.k_norm.eps
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
