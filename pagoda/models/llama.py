"""Llama-family decoder: Llama 2/3, SmolLM2, Qwen2 (q/k/v bias); Mistral and Qwen3 build on it
(mistral.py, qwen3.py). What every family shares (the stack, weight routing, kernel backends) is
models/base.py's.

Parameter names follow HF (model.layers.N.self_attn.q_proj, ...). The forward pass takes the
flat batch (all scheduled tokens of all requests, concatenated) and must run inside
`forward_context(...)`, which supplies the paged KV caches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagoda.layers.activation import GeluTanhAndMul, SiluAndMul
from pagoda.layers.attention import Attention
from pagoda.layers.forward_context import ForwardContext
from pagoda.layers.linear import Linear, MergedLinear
from pagoda.layers.norm import CPU_ROW_DTYPES, RMSNorm
from pagoda.layers.parallel import SINGLE, PipelineStage, TensorParallel
from pagoda.layers.rotary import (
    apply_partial_rotary,
    apply_rotary,
    get_rope,
    rope_parameters,
    rotary_dim_of,
)
from pagoda.model_config import head_dim_of, sliding_window_of
from pagoda.models.base import DecoderForCausalLM, DecoderModel
from pagoda.models.family import ModelFamily

FAMILY = ModelFamily(
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    gguf_archs=("llama",),
    gguf_permute_qk=True,
)
QWEN2_FAMILY = ModelFamily(
    architectures=("Qwen2ForCausalLM",), model_types=("qwen2",), gguf_archs=("qwen2",)
)


# HF activation name -> the gated activation over gate_up_proj
GATED_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
}


class LlamaMLP(nn.Module):
    """gate_up_proj, the gated activation (SiLU-and-mul for Llama), down_proj: run by the
    decoder layer, which feeds gate_up_proj its norm (Linear.after_norm) and down_proj its
    activation (after_act)."""

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        act: str = "",
        intermediate_size: int = 0,
    ) -> None:
        """act: the HF activation name (config.hidden_act when empty); intermediate_size:
        config.intermediate_size when 0 (a mixture's experts have their own)."""
        super().__init__()
        hidden = config.hidden_size
        bias = bool(getattr(config, "mlp_bias", False))
        act = act or config.hidden_act
        if act not in GATED_ACTIVATIONS:
            raise ValueError(
                f"hidden activation {act!r} is not supported; supported: "
                f"{', '.join(GATED_ACTIVATIONS)}"
            )
        # tensor parallel: gate/up split by rows (column-parallel), down_proj by columns
        part = tp.part(intermediate_size or config.intermediate_size, "intermediate_size")
        inter = part[1]
        self.gate_up_proj = MergedLinear(
            hidden, {"gate": inter, "up": inter}, bias, dtype, tp, {"gate": part, "up": part}
        )
        self.down_proj = Linear(inter, hidden, bias, dtype, tp, part)
        self.act_fn = GATED_ACTIVATIONS[act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size), already normalized -> (num_tokens, hidden_size)
        return self.down_proj.after_act(self.gate_up_proj(x), self.act_fn)


class LlamaAttention(nn.Module):
    """qkv_proj, then `attend` (rotary, the KV-cache write, paged attention), then o_proj: run by
    LlamaDecoderLayer.forward, which feeds qkv_proj its norm (Linear.after_norm)."""

    qkv_bias = False  # bias on q/k/v even without `attention_bias` (Qwen2)
    backend = "torch"  # "triton": rotary fused into the KV-cache write; set by the model runner
    # rotary of CPU_ROW_DTYPES on pagoda's C++ kernels (kernels/cpu/row_ops.cpp)
    cpu_kernel = False

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        index: int | None = None,
    ) -> None:
        """layer_idx: the KV cache this layer reads on its stage; index: the checkpoint's layer
        (its window; layer_idx when None)."""
        super().__init__()
        # This rank's heads (all of them without tensor parallelism): layers/parallel.py
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        (first_head, self.num_heads), (first_kv_head, self.num_kv_heads) = tp.heads(
            total_heads, total_kv_heads
        )
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias or self.qkv_bias
        d = self.head_dim
        q_part = (first_head * d, self.q_size)
        kv_part = (first_kv_head * d, self.kv_size)
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            qkv_bias,
            dtype,
            tp,
            {"q": q_part, "k": kv_part, "v": kv_part},
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, attention_bias, dtype, tp, q_part)
        scale = self.attention_scale(config)
        # q and k are still adjacent in qkv at rotary time unless a subclass transforms them
        self.joint_rotary = type(self).qk_transform is LlamaAttention.qk_transform
        # the first rotary_dim values of each head rotate (Phi-4-mini: 3/4 of them)
        self.rotary_dim = self.rotary_dim_of(config)
        window = sliding_window_of(config, layer_idx if index is None else index)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            scale,
            layer_idx,
            sliding_window=window,
        )

    def rotary_dim_of(self, config: Any) -> int:
        """The values of each head that rotate (the config's partial_rotary_factor share)."""
        return rotary_dim_of(rope_parameters(config), self.head_dim)

    def attention_scale(self, config: Any) -> float:
        """The softmax scale of q.k (Gemma: query_pre_attn_scalar ** -0.5)."""
        return float(self.head_dim**-0.5)

    def attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext | None = None,
    ) -> torch.Tensor:
        """Attention from the packed projection, before o_proj: rotary, the KV-cache write and
        paged attention. qkv: (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim) ->
        (num_tokens, num_heads * head_dim)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.rotary_dim != self.head_dim:  # partial rotary: torch on every backend
            q, k = self.qk_transform(q, k)
            q = apply_partial_rotary(q, cos, sin, self.head_dim, self.rotary_dim)
            k = apply_partial_rotary(k, cos, sin, self.head_dim, self.rotary_dim)
            return self.attn(q, k, v, ctx)
        if self.backend == "triton":
            # One launch: q/k per-head norm (if any), q rotated in place, k rotated into the
            # cache, v written.
            norm = self.qk_norm_weights()
            if norm is None:
                q, k = self.qk_transform(q, k)
            return self.attn(q, k, v, ctx, rotary=(cos, sin), qk_norm=norm)
        q, k = self.qk_transform(q, k)
        on_cpu = self.cpu_kernel and qkv.dtype in CPU_ROW_DTYPES and cos.dtype == qkv.dtype
        rotate = self._rotate_cpu if on_cpu else apply_rotary
        if self.joint_rotary:
            # q and k are adjacent in qkv: one rotation over both heads' rows
            qk = rotate(qkv[:, : self.q_size + self.kv_size], cos, sin, self.head_dim)
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        else:
            q = rotate(q, cos, sin, self.head_dim)  # (num_tokens, num_heads * head_dim)
            k = rotate(k, cos, sin, self.head_dim)  # (num_tokens, num_kv_heads * head_dim)
        return self.attn(q, k, v, ctx)  # (num_tokens, num_heads * head_dim)

    @staticmethod
    def _rotate_cpu(
        x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
    ) -> torch.Tensor:
        """apply_rotary on pagoda's CPU kernels; cos, sin: (num_tokens, 1, head_dim // 2)."""
        return torch.ops.pagoda_cpu.rotary(x, cos.squeeze(1), sin.squeeze(1), head_dim, 2)

    def qk_transform(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook applied to q and k before rotary (Qwen3 normalizes per head here)."""
        return q, k

    def qk_norm_weights(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(q weight, k weight, eps) when qk_transform is exactly a per-head RMSNorm of q and of
        k: the triton backend then fuses it into its rotary launch instead of calling it."""
        return None


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        dtype: torch.dtype,
        attention_cls: type[LlamaAttention],
        tp: TensorParallel = SINGLE,
        index: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx, dtype, tp, index)
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
        # hidden_states, residual: (num_tokens, hidden_size); residual is None for layer 0.
        # Each norm runs with the projection after it (Linear.after_norm: one op on the CPU
        # kernels), SiLU-and-mul with gate_up_proj where its kernels can (gated_after_norm),
        # else with down_proj.
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = attn.qkv_proj.after_norm(hidden_states, residual, self.input_layernorm)
        hidden_states = attn.o_proj(attn.attend(qkv, *rope, ctx))  # (num_tokens, hidden_size)
        norm = self.post_attention_layernorm
        gated = mlp.gate_up_proj.gated_after_norm(hidden_states, residual, norm, mlp.act_fn)
        if gated is not None:
            act, residual = gated
            return mlp.down_proj(act), residual
        gate_up, residual = mlp.gate_up_proj.after_norm(hidden_states, residual, norm)
        return mlp.down_proj.after_act(gate_up, mlp.act_fn), residual

    def forward_fused(
        self,
        stream: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext | None = None,
    ) -> torch.Tensor:
        """The same layer in 7 launches for at most fused_linear.MAX_ROWS tokens (triton backend,
        unquantized linears): the norms, the residual adds and SiLU-and-mul run inside the
        projections (kernels/fused_linear.py). stream: (num_tokens, hidden_size), the residual
        stream (`hidden_states + residual` of `forward`) -> the next layer's stream."""
        from pagoda.kernels.fused_linear import fused_linear

        attn, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        qkv_proj, o_proj = attn.qkv_proj, attn.o_proj
        qkv = fused_linear(stream, qkv_proj.weight, qkv_proj.bias, norm=(norm1.weight, norm1.eps))
        out = attn.attend(qkv, *rope, ctx)  # (num_tokens, num_heads * head_dim)
        stream = fused_linear(out, o_proj.weight, o_proj.bias, residual=stream)
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        norm = (norm2.weight, norm2.eps)
        act = fused_linear(stream, gate_up.weight, gate_up.bias, norm=norm, silu_mul=True)
        return fused_linear(act, down.weight, down.bias, residual=stream)


class LlamaModel(DecoderModel):
    """The decoder stack with one rotary embedding for every layer; its layers are
    LlamaDecoderLayer with `attention_cls`, or what `make_layer` builds (a family whose layers
    differ only in their MLP, Qwen3-MoE)."""

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        tp: TensorParallel,
        pp: PipelineStage,
        attention_cls: type[LlamaAttention] | None = None,
        make_layer: Callable[[int, int], nn.Module] | None = None,
    ) -> None:
        def make_llama_layer(index: int, cache_index: int) -> nn.Module:
            assert attention_cls is not None
            return LlamaDecoderLayer(config, cache_index, dtype, attention_cls, tp, index)

        super().__init__(config, dtype, tp, pp, make_layer or make_llama_layer)
        self.rotary_emb = get_rope(
            config, head_dim_of(config), config.max_position_embeddings, dtype
        )

    def rotary(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb.cos_sin(positions, dtype)


class LlamaForCausalLM(DecoderForCausalLM):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def make_model(
        self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, pp: PipelineStage
    ) -> DecoderModel:
        return LlamaModel(hf_config, dtype, tp, pp, self.attention_cls)


class Qwen2Attention(LlamaAttention):
    qkv_bias = True


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
