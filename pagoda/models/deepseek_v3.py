"""DeepSeek-V3 (and Kimi-K2, which keeps its architecture): multi-head latent attention over a
latent KV cache (layers/latent_attention.py) and, past the first `first_k_dense_replace` dense
layers, a mixture of routed experts beside always-on shared experts.

Attention (per token; H heads, rank = kv_lora_rank, nope / rope / v the head sizes):
    q = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x))   (H, nope + rope)
    [latent, k_pe] = kv_a_proj_with_mqa(x)                     (rank + rope)
    row = [kv_a_layernorm(latent), rotary(k_pe)]               cached, shared by every head
kv_b_proj (H * (nope + v), rank) is never applied to the cache: its key half is absorbed into
the query and its value half into the output (latent_attention.py), so a step reads rank + rope
values per cached token and layer (576 for V3: 70 KB a token in bf16 over 61 layers, where full
K and V of 128 heads would take 4.9 MB).

Routing (HF's DeepseekV3TopkRouter): sigmoid scores of a float32 router; the experts are chosen
on score + e_score_correction_bias within the `topk_group` groups (of `n_group`) whose best two
biased scores sum highest; their weights are the unbiased scores, renormalized when
norm_topk_prob, times routed_scaling_factor.

Not yet: tensor parallelism (kv_b_proj's heads are not split: TP > 1 raises), GGUF files
(llama.cpp's `deepseek2` tensors), the C++ / Triton kernels over a latent cache.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.forward_context import ForwardContext
from pagoda.layers.latent_attention import LatentAttention
from pagoda.layers.linear import Linear
from pagoda.layers.moe import SparseMoE
from pagoda.layers.norm import RMSNorm
from pagoda.layers.parallel import SINGLE, PipelineStage, TensorParallel
from pagoda.layers.rotary import apply_rotary, get_rope, rope_parameters, yarn_factor, yarn_mscale
from pagoda.models.base import DecoderModel
from pagoda.models.family import ModelFamily
from pagoda.models.llama import LlamaMLP
from pagoda.models.qwen3_moe import MoECausalLM

FAMILY = ModelFamily(architectures=("DeepseekV3ForCausalLM",), model_types=("deepseek_v3",))


class KVUpProjection(nn.Module):
    """kv_b_proj's weight (H * (nope + v), rank), kept whole and unquantized: its halves are
    multiplied into the queries and outputs per head, never applied as a layer."""

    def __init__(self, num_heads: int, nope: int, v: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.nope, self.v, self.rank = num_heads, nope, v, rank
        self.weight = nn.Parameter(torch.empty(num_heads * (nope + v), rank, dtype=dtype))

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        # q_nope: (num_tokens, H, nope) -> (num_tokens, H, rank): W_UK[h]^T q_nope_h
        w_uk = self.weight.view(self.num_heads, self.nope + self.v, self.rank)[:, : self.nope]
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def expand_output(self, o_latent: torch.Tensor) -> torch.Tensor:
        # o_latent: (num_tokens, H, rank) -> (num_tokens, H * v): W_UV[h] o_latent_h
        w_uv = self.weight.view(self.num_heads, self.nope + self.v, self.rank)[:, self.nope :]
        out = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2))  # (H, num_tokens, v)
        return out.transpose(0, 1).reshape(o_latent.shape[0], self.num_heads * self.v)


class DeepseekV3Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = 1  # one latent row per token, shared by every head
        self.nope = config.qk_nope_head_dim
        self.rope = config.qk_rope_head_dim
        self.rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        hidden, heads, qk_dim = config.hidden_size, self.num_heads, self.nope + self.rope
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps, dtype)
            self.q_b_proj = Linear(self.q_lora_rank, heads * qk_dim, False, dtype)
        else:
            self.q_proj = Linear(hidden, heads * qk_dim, False, dtype)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps, dtype)
        self.kv_b_proj = KVUpProjection(heads, self.nope, config.v_head_dim, self.rank, dtype)
        self.o_proj = Linear(heads * config.v_head_dim, hidden, bias, dtype)
        self.interleaved = bool(getattr(config, "rope_interleave", True))
        self.attn = LatentAttention(heads, self.rank, self.attention_scale(config), layer_idx)

    @staticmethod
    def attention_scale(config: Any) -> float:
        """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared when the
        rope is scaled (HF's yarn_apply_mscale)."""
        scale = float((config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5)
        params = rope_parameters(config)
        mscale_all_dim = params.get("mscale_all_dim")
        if params["rope_type"] != "default" and mscale_all_dim:
            m = yarn_mscale(yarn_factor(params, config.max_position_embeddings), mscale_all_dim)
            scale *= m * m
        return scale

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary over heads of `rope` values. x: (num_tokens, heads * rope) -> like x. An
        interleaved checkpoint pairs (x0, x1), (x2, x3), ...: its evens and odds are gathered
        into halves first (HF's apply_rotary_pos_emb_interleave), the same for q and k."""
        if self.interleaved:
            heads = x.view(x.shape[0], -1, self.rope)
            x = torch.cat((heads[..., 0::2], heads[..., 1::2]), dim=-1).view(x.shape[0], -1)
        return apply_rotary(x, cos, sin, self.rope)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext | None = None,
    ) -> torch.Tensor:
        # x: (num_tokens, hidden_size), normalized -> (num_tokens, hidden_size)
        num_tokens = x.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(num_tokens, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_pe = self._rotate(q_pe.reshape(num_tokens, -1), cos, sin)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        rows = torch.cat((self.kv_a_layernorm(latent), self._rotate(k_pe, cos, sin)), dim=-1)
        q_absorbed = torch.cat(
            (
                self.kv_b_proj.absorb_query(q_nope),
                q_pe.view(num_tokens, self.num_heads, self.rope),
            ),
            dim=-1,
        )  # (num_tokens, H, rank + rope)
        o_latent = self.attn(q_absorbed, rows, ctx)  # (num_tokens, H, rank)
        return self.o_proj(self.kv_b_proj.expand_output(o_latent))


class DeepseekRouter(nn.Module):
    """weight: (num_experts, hidden_size) and e_score_correction_bias: (num_experts,), HF's
    mlp.gate, both float32 whatever the model dtype (as HF keeps them)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32))
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group or 1
        self.topk_group = config.topk_group or 1
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.scaling = float(config.routed_scaling_factor)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_tokens, top_k) expert ids and weights (float32) of x (num_tokens, hidden)."""
        scores = F.linear(x.float(), self.weight).sigmoid()  # (num_tokens, num_experts)
        biased = scores + self.e_score_correction_bias
        grouped = biased.view(x.shape[0], self.n_group, -1)  # (num_tokens, groups, per group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (num_tokens, groups)
        groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        biased = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(1)
        ids = torch.topk(biased, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class DeepseekMoE(SparseMoE):
    """Routed experts (DeepseekRouter's choice) plus the shared experts every token runs."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        inter = config.moe_intermediate_size

        def make_expert(e: int) -> nn.Module:
            return LlamaMLP(config, dtype, SINGLE, intermediate_size=inter)

        experts, top_k = config.n_routed_experts, config.num_experts_per_tok
        router = DeepseekRouter(config)
        super().__init__(
            config.hidden_size, experts, top_k, False, make_expert, dtype, SINGLE, router
        )
        shared = inter * config.n_shared_experts
        self.shared_experts = LlamaMLP(config, dtype, SINGLE, intermediate_size=shared)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights = cast(DeepseekRouter, self.gate).route(x)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size) -> (num_tokens, hidden_size)
        return super().forward(x) + self.shared_experts(x)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        self.self_attn = DeepseekV3Attention(config, layer_idx, dtype)
        self.mlp: nn.Module
        if index >= config.first_k_dense_replace:
            self.mlp = DeepseekMoE(config, dtype)
        else:
            self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, normed = hidden_states, self.input_layernorm(hidden_states)
        else:
            normed, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(normed, *rope, ctx)  # (num_tokens, hidden_size)
        normed, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(normed), residual


class DeepseekV3Model(DecoderModel):
    def __init__(
        self, config: Any, dtype: torch.dtype, tp: TensorParallel, pp: PipelineStage
    ) -> None:
        def make_layer(index: int, cache_index: int) -> nn.Module:
            return DeepseekV3DecoderLayer(config, cache_index, dtype, index)

        super().__init__(config, dtype, tp, pp, make_layer)
        self.rotary_emb = get_rope(
            config, config.qk_rope_head_dim, config.max_position_embeddings, dtype
        )

    def rotary(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb.cos_sin(positions, dtype)


class DeepseekV3ForCausalLM(MoECausalLM):
    def make_model(
        self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, pp: PipelineStage
    ) -> DecoderModel:
        if tp.size > 1:
            raise ValueError(
                "tensor parallelism is not supported for DeepSeek's latent attention yet; run "
                "with --tensor-parallel-size 1 (--pipeline-parallel-size splits the layers)"
            )
        return DeepseekV3Model(hf_config, dtype, tp, pp)

    def num_experts_of(self, index: int) -> int | None:
        dense = index < self.config.first_k_dense_replace
        return None if dense else int(self.config.n_routed_experts)
