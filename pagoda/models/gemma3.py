"""Gemma 3 (text): the Llama decoder with
- the embedding scaled by sqrt(hidden_size) (the tied LM head reads the unscaled matrix);
- (1 + weight) RMSNorms (GemmaRMSNorm holds 1 + w), four per layer: before and after attention,
  before and after the MLP, the after-norms applied to the sub-block's output before the
  residual add;
- per-head q/k norms (as Qwen3) and the softmax scale query_pre_attn_scalar ** -0.5;
- GeGLU (gelu tanh) instead of SwiGLU;
- local layers attending a sliding window and global layers the whole context (`layer_types`,
  5 local : 1 global; model_config.py, sliding_window_of), each kind with its own RoPE base
  (`rope_parameters` per layer type).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from pagoda.layers.forward_context import ForwardContext
from pagoda.layers.norm import RMSNorm
from pagoda.layers.parallel import SINGLE, PipelineStage, TensorParallel
from pagoda.layers.rotary import RotaryEmbedding, compute_inv_freq
from pagoda.model_config import head_dim_of
from pagoda.models.base import DecoderForCausalLM, DecoderModel
from pagoda.models.family import ModelFamily
from pagoda.models.llama import LlamaMLP
from pagoda.models.qwen3 import Qwen3Attention


def _gguf_config(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """What transformers' GGUF conversion gets wrong for Gemma 3, as llama.cpp reads the file:
    the softmax scale (1 / sqrt(head_dim), but hidden / heads for the 62-layer 27B; no file
    states query_pre_attn_scalar) and the global layers' linear rope scaling (factor 8 on the
    4B and larger models), which the conversion drops."""
    heads = int(fields[f"{arch}.attention.head_count"])
    head_dim = int(fields.get(f"{arch}.attention.key_length") or 256)
    big = int(fields[f"{arch}.block_count"]) == 62
    out: dict[str, Any] = {
        "query_pre_attn_scalar": int(fields[f"{arch}.embedding_length"]) // heads
        if big
        else head_dim
    }
    if fields.get(f"{arch}.rope.scaling.type") == "linear":
        local_base = float(fields.get(f"{arch}.rope.freq_base_swa") or 10000.0)
        local = {"rope_type": "default", "rope_theta": local_base}
        factor = float(fields[f"{arch}.rope.scaling.factor"])
        base = float(fields[f"{arch}.rope.freq_base"])
        glob = {"rope_type": "linear", "rope_theta": base, "factor": factor}
        out["rope_parameters"] = {"sliding_attention": local, "full_attention": glob}
    return out


FAMILY = ModelFamily(
    architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text", "gemma3"),
    gguf_archs=("gemma3",),
    gguf_layer_names={
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    gguf_norm_shift=1.0,
    gguf_config_rule=_gguf_config,
)


class GemmaRMSNorm(RMSNorm):
    weight_offset = 1.0  # the parameter holds 1 + w (RMSNorm.from_checkpoint)


class Gemma3Attention(Qwen3Attention):
    norm_cls = GemmaRMSNorm

    def attention_scale(self, config: Any) -> float:
        return float(config.query_pre_attn_scalar) ** -0.5

    def rotary_dim_of(self, config: Any) -> int:
        return self.head_dim  # rope_parameters per layer type, each rotating whole heads


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        index: int = 0,
    ) -> None:
        super().__init__()
        self.layer_type = config.layer_types[index]
        self.self_attn = Gemma3Attention(config, layer_idx, dtype, tp, index)
        self.mlp = LlamaMLP(config, dtype, tp, act=config.hidden_activation)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        ctx: ForwardContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden_states, residual: (num_tokens, hidden_size), their sum the residual stream
        # (residual None for layer 0); returns this layer's output and the stream before it
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = attn.qkv_proj.after_norm(hidden_states, residual, self.input_layernorm)
        out = attn.o_proj(attn.attend(qkv, *rope[self.layer_type], ctx))
        out = self.post_attention_layernorm(out)  # (num_tokens, hidden_size)
        gate_up, residual = mlp.gate_up_proj.after_norm(
            out, residual, self.pre_feedforward_layernorm
        )
        out = mlp.down_proj.after_act(gate_up, mlp.act_fn)
        return self.post_feedforward_layernorm(out), residual


def rope_parameters_by_type(config: Any) -> dict[str, dict[str, Any]]:
    """RoPE settings per layer type: transformers >= 5 keeps them per type in
    rope_parameters; older configs have rope_theta (+ rope_scaling) for global layers and
    rope_local_base_freq for local ones."""
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return {k: dict(v) for k, v in params.items()}
    full = dict(getattr(config, "rope_scaling", None) or {"rope_type": "default"})
    full.setdefault("rope_type", full.pop("type", "default"))
    full["rope_theta"] = float(getattr(config, "rope_theta", None) or 1_000_000.0)
    local = {"rope_type": "default", "rope_theta": float(config.rope_local_base_freq)}
    return {"full_attention": full, "sliding_attention": local}


class Gemma3Model(DecoderModel):
    def __init__(
        self, config: Any, dtype: torch.dtype, tp: TensorParallel, pp: PipelineStage
    ) -> None:
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, name, None) is not None:
                raise ValueError(f"Gemma 3 with {name} set is not supported")

        def make_layer(index: int, cache_index: int) -> nn.Module:
            return Gemma3DecoderLayer(config, cache_index, dtype, tp, index)

        super().__init__(config, dtype, tp, pp, make_layer)
        # HF: a float32 scalar cast to the weights' dtype
        scale = torch.tensor(config.hidden_size**0.5).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)
        head_dim = head_dim_of(config)
        params = rope_parameters_by_type(config)
        self.rotary_embs = nn.ModuleDict(
            {
                kind: RotaryEmbedding(
                    head_dim,
                    config.max_position_embeddings,
                    compute_inv_freq(params[kind], head_dim),
                    dtype,
                )
                for kind in sorted(set(config.layer_types))
            }
        )

    def make_norm(self, config: Any, dtype: torch.dtype) -> RMSNorm:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * cast(torch.Tensor, self.embed_scale)

    def rotary(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        ropes = cast(dict[str, RotaryEmbedding], self.rotary_embs)
        return {kind: rope.cos_sin(positions, dtype) for kind, rope in ropes.items()}


class Gemma3ForCausalLM(DecoderForCausalLM):
    def make_model(
        self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, pp: PipelineStage
    ) -> DecoderModel:
        return Gemma3Model(hf_config, dtype, tp, pp)
