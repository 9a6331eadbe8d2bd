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

GGUF files: llama.cpp's `deepseek2` (FAMILY), whose config pagoda builds itself (transformers
reads none) and whose kv_b_proj comes cut per head (`attn_k_b` transposed, `attn_v_b`), joined
back here; files routed otherwise than by V3's sigmoid (DeepSeek-V2's softmax) are refused.

Tensor parallelism splits the heads (DeepseekV3Attention; the latent cache is whole on every
rank) and the routed experts (expert parallelism), as vLLM does without data-parallel attention.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.forward_context import ForwardContext
from pagoda.layers.gguf import GGUFWeight
from pagoda.layers.latent_attention import LatentAttention
from pagoda.layers.linear import Linear
from pagoda.layers.moe import SparseMoE
from pagoda.layers.norm import RMSNorm
from pagoda.layers.parallel import SINGLE, PipelineStage, TensorParallel
from pagoda.layers.rotary import apply_rotary, get_rope, rope_parameters, yarn_factor, yarn_mscale
from pagoda.models.base import DecoderModel
from pagoda.models.family import ModelFamily
from pagoda.models.llama import LlamaMLP
from pagoda.models.qwen3_moe import MOE_GGUF_LAYER_NAMES, MoECausalLM

# llama.cpp's names of the latent attention, the shared experts and the router's bias
_GGUF_LAYER_NAMES = {
    **MOE_GGUF_LAYER_NAMES,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # files before llama.cpp cut it per head
    "attn_k_b": "self_attn.k_b_proj",  # kv_b_proj's key half: _joined_kv_b
    "attn_v_b": "self_attn.v_b_proj",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# llama.cpp's expert_gating_func values; V3's sigmoid (2) is the only one DeepseekRouter runs.
# A file stating none routes by softmax there (DeepSeek-V2 / V2.5 files).
_SIGMOID = 2
_GATING = {
    0: "softmax (llama.cpp's default)",
    1: "softmax",
    3: "softmax_weight",
    4: "sqrt_softplus",
}


def _gguf_config(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """What llama.cpp derives from a deepseek2 file: the query/key split (key_length_mla is
    nope + rope; older files state it as key_length), the value size, every head's own keys
    (head_count_kv 1 is the shared latent) and the rope; ValueError for what pagoda does not run
    (_check_gguf_file)."""

    def get(key: str) -> Any:
        return fields.get(f"{arch}.{key}")

    _check_gguf_file(get)
    rope = int(get("rope.dimension_count"))
    key_length = int(get("attention.key_length_mla") or get("attention.key_length"))
    return {
        "num_key_value_heads": int(get("attention.head_count")),
        "qk_nope_head_dim": key_length - rope,
        "v_head_dim": int(get("attention.value_length_mla") or get("attention.value_length")),
        "rope_parameters": _gguf_rope(get),
    }


def _check_gguf_file(get: Callable[[str], Any]) -> None:
    """ValueError for a mixture routed otherwise than by V3's sigmoid (DeepSeek-V2's softmax,
    which llama.cpp also assumes where a file states none) or with per-layer expert counts, and
    for temperature-tuned attention."""
    sparse = int(get("leading_dense_block_count") or 0) < int(get("block_count"))
    if sparse and int(get("expert_count") or 0):
        gating = int(get("expert_gating_func") or 0)
        if gating != _SIGMOID:
            raise ValueError(
                f"this deepseek2 file routes its experts by {_GATING.get(gating, gating)} "
                f"(expert_gating_func {gating}); pagoda runs DeepSeek-V3's router only "
                "(sigmoid scores with a correction bias), not DeepSeek-V2's softmax"
            )
        if get("expert_used_count") is None:
            raise ValueError("this deepseek2 file states no single expert_used_count")
    if get("attention.temperature_scale"):
        raise ValueError("deepseek2 attention temperature tuning is not supported")


def _gguf_rope(get: Callable[[str], Any]) -> dict[str, Any]:
    """The file's rope in HF's terms. YaRN's mscale_all_dim is kept times 0.1 (llama.cpp's
    legacy yarn_log_multiplier) and mscale taken equal to it, as llama.cpp does (V2's and V3's
    configs set both alike): cos and sin unscaled, the temperature in the softmax scale."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base"))}
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return rope
    if kind != "yarn":
        raise ValueError(f"deepseek2 rope scaling {kind!r} is not supported (only yarn)")
    rope |= {
        "rope_type": "yarn",
        "factor": float(get("rope.scaling.factor")),
        "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
        "beta_fast": float(get("rope.scaling.yarn_beta_fast") or 32.0),
        "beta_slow": float(get("rope.scaling.yarn_beta_slow") or 1.0),
    }
    if get("rope.scaling.yarn_log_multiplier"):
        mscale = float(get("rope.scaling.yarn_log_multiplier")) / 0.1
        rope |= {"mscale": mscale, "mscale_all_dim": mscale}
    return rope


FAMILY = ModelFamily(
    architectures=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3",),
    gguf_archs=("deepseek2",),
    gguf_layer_names=_GGUF_LAYER_NAMES,
    gguf_model_type="deepseek_v3",  # transformers' GGUF conversion reads no deepseek2 file
    gguf_config_fields={
        "leading_dense_block_count": "first_k_dense_replace",
        "attention.q_lora_rank": "q_lora_rank",
        "attention.kv_lora_rank": "kv_lora_rank",
        "rope.dimension_count": "qk_rope_head_dim",
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_count": "n_routed_experts",
        "expert_used_count": "num_experts_per_tok",
        "expert_shared_count": "n_shared_experts",
        "expert_group_count": "n_group",
        "expert_group_used_count": "topk_group",
        "expert_weights_scale": "routed_scaling_factor",
        "expert_weights_norm": "norm_topk_prob",
    },
    # llama.cpp's reading of what a file leaves out (the config class's defaults are V3's):
    # no q_lora_rank is a plain q_proj, no groups one group, no scale 1, no norm none
    gguf_config_values={
        "q_lora_rank": None,
        "first_k_dense_replace": 0,
        "n_shared_experts": 0,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "rope_interleave": True,  # llama.cpp's rope on deepseek2 pairs neighbours
    },
    gguf_config_rule=_gguf_config,
)


def head_share(config: Any, tp: TensorParallel) -> tuple[int, int]:
    """(first head, heads) of this rank: an equal share; ValueError where the size does not
    divide the heads."""
    return tp.part(config.num_attention_heads, "the number of attention heads")


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
    """Under tensor parallelism a rank holds an equal share of the heads: their rows of q_b_proj
    (or q_proj) and kv_b_proj, their columns of o_proj (whose partial products are summed). The
    latent projections (q_a_proj, kv_a_proj_with_mqa) and so the latent cache are whole on every
    rank, as vLLM keeps them."""

    def __init__(
        self, config: Any, layer_idx: int, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.first_head, self.num_heads = head_share(config, tp)
        self.num_kv_heads = 1  # one latent row per token, shared by every head
        self.nope = config.qk_nope_head_dim
        self.rope = config.qk_rope_head_dim
        self.rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        hidden, heads, qk_dim = config.hidden_size, self.num_heads, self.nope + self.rope
        v_dim = config.v_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        q_part = (self.first_head * qk_dim, heads * qk_dim)
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps, dtype)
            self.q_b_proj = Linear(
                self.q_lora_rank, heads * qk_dim, False, dtype, tp, out_part=q_part
            )
        else:
            self.q_proj = Linear(hidden, heads * qk_dim, False, dtype, tp, out_part=q_part)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps, dtype)
        self.kv_b_proj = KVUpProjection(heads, self.nope, v_dim, self.rank, dtype)
        o_part = (self.first_head * v_dim, heads * v_dim)
        self.o_proj = Linear(heads * v_dim, hidden, bias, dtype, tp, in_part=o_part)
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
    """Routed experts (DeepseekRouter's choice) plus the shared experts every token runs. Under
    tensor parallelism a rank holds an equal share of the routed experts whole (expert
    parallelism, layers/moe.py) and a slice of the shared experts' MLP, as a dense layer's."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel) -> None:
        inter = config.moe_intermediate_size

        def make_expert(e: int) -> nn.Module:
            return LlamaMLP(config, dtype, SINGLE, intermediate_size=inter)

        experts, top_k = config.n_routed_experts, config.num_experts_per_tok
        router = DeepseekRouter(config)
        super().__init__(config.hidden_size, experts, top_k, False, make_expert, dtype, tp, router)
        shared = inter * config.n_shared_experts
        self.shared_experts = LlamaMLP(config, dtype, tp, intermediate_size=shared)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights = cast(DeepseekRouter, self.gate).route(x)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size) -> (num_tokens, hidden_size)
        return super().forward(x) + self.shared_experts(x)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, dtype: torch.dtype, index: int, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.self_attn = DeepseekV3Attention(config, layer_idx, dtype, tp)
        self.mlp: nn.Module
        if index >= config.first_k_dense_replace:
            self.mlp = DeepseekMoE(config, dtype, tp)
        else:
            self.mlp = LlamaMLP(config, dtype, tp)
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
            return DeepseekV3DecoderLayer(config, cache_index, dtype, index, tp)

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
        head_share(hf_config, tp)  # a size that does not divide the heads: its ValueError here
        return DeepseekV3Model(hf_config, dtype, tp, pp)

    def num_experts_of(self, index: int) -> int | None:
        dense = index < self.config.first_k_dense_replace
        return None if dense else int(self.config.n_routed_experts)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        joined = _joined_kv_b(weights, self.config.num_attention_heads)
        return super().load_weights(_rank_kv_b(joined, self.config, self.tp))


def _rank_kv_b(
    weights: Iterable[tuple[str, Any]], config: Any, tp: TensorParallel
) -> Iterator[tuple[str, Any]]:
    """kv_b_proj's rows of this rank's heads (head_share), the rest of the checkpoint as it is."""
    first, heads = head_share(config, tp)
    per_head = config.qk_nope_head_dim + config.v_head_dim
    for name, tensor in weights:
        if tp.size > 1 and name.endswith("self_attn.kv_b_proj.weight"):
            if isinstance(tensor, GGUFWeight):
                tensor = tensor.dequantize()
            tensor = tensor[first * per_head : (first + heads) * per_head]
        yield name, tensor


def _joined_kv_b(weights: Iterable[tuple[str, Any]], heads: int) -> Iterator[tuple[str, Any]]:
    """kv_b_proj's weight (H * (nope + v), rank), per head its nope key rows then its v value
    rows (HF's layout), joined from a GGUF file's halves: attn_k_b (H, rank, nope), each head's
    key rows transposed, and attn_v_b (H, v, rank). Quantized halves are decoded: kv_b_proj
    stays float (KVUpProjection)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, half = name.removesuffix(".weight").rpartition(".")
        if half not in ("k_b_proj", "v_b_proj"):
            yield name, tensor
            continue
        pair = halves.setdefault(prefix, {})
        pair[half] = tensor.dequantize() if isinstance(tensor, GGUFWeight) else tensor
        if len(pair) == 2:
            del halves[prefix]
            v_b = pair["v_b_proj"]
            rank = v_b.shape[-1]
            k = pair["k_b_proj"].reshape(heads, rank, -1).transpose(1, 2)  # (H, nope, rank)
            joined = torch.cat((k, v_b.reshape(heads, -1, rank)), dim=1)
            yield f"{prefix}.kv_b_proj.weight", joined.reshape(-1, rank)
