"""Qwen3-MoE: Qwen3's attention with a sparse mixture of experts in place of the MLP
(layers/moe.py) on every `decoder_sparse_step`-th layer not in `mlp_only_layers`; the others
keep a dense MLP. Checkpoints name each expert (mlp.experts.E.gate_proj, ...); a GGUF file
holds each projection of all experts in one tensor (`ffn_gate_exps`, ...), cut into experts
here as it loads (their blocks stay quantized)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda.layers.forward_context import ForwardContext
from pagoda.layers.moe import SparseMoE
from pagoda.layers.norm import RMSNorm
from pagoda.layers.parallel import SINGLE, PipelineStage, TensorParallel
from pagoda.models.base import DecoderForCausalLM, DecoderModel
from pagoda.models.family import ModelFamily
from pagoda.models.llama import LlamaAttention, LlamaMLP, LlamaModel
from pagoda.models.qwen3 import Qwen3Attention

# llama.cpp's names of a mixture's router and stacked experts (Qwen3-MoE's and Mixtral's files)
MOE_GGUF_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}

FAMILY = ModelFamily(
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    gguf_archs=("qwen3moe",),
    gguf_layer_names=MOE_GGUF_LAYER_NAMES,
    # transformers' GGUF conversion names expert_count num_local_experts (Mixtral's name), so
    # a file's Qwen3MoeConfig had no num_experts
    gguf_config_fields={
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_count": "num_experts",
        "attention.key_length": "head_dim",
    },
    # llama.cpp renormalizes qwen3moe's top-k weights; transformers' default is False
    gguf_config_values={"norm_topk_prob": True},
)

# all experts' projection in one tensor: a GGUF file's (mlp.experts.gate_proj.weight, ...) or
# transformers 5's fused parameters (mlp.experts.gate_up_proj, mlp.experts.down_proj)
_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj|gate_up_proj)(\.weight)?$")
# one expert's projection: model.layers.N.mlp.experts.E.<proj>.weight
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.")


@dataclass(frozen=True)
class MoESpec:
    """A layer's mixture, as its family's config names it."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool  # renormalize the top k weights to sum 1
    intermediate_size: int  # of each expert


class MoEDecoderLayer(nn.Module):
    """The Llama layer with a sparse mixture (`spec`; None: a dense MLP) after attention."""

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        dtype: torch.dtype,
        tp: TensorParallel,
        index: int,
        attention_cls: type[LlamaAttention],
        spec: MoESpec | None,
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx, dtype, tp, index)
        self.mlp: nn.Module
        if spec is not None:

            def make_expert(e: int) -> nn.Module:
                return LlamaMLP(config, dtype, SINGLE, intermediate_size=spec.intermediate_size)

            self.mlp = SparseMoE(
                config.hidden_size,
                spec.num_experts,
                spec.top_k,
                spec.norm_topk_prob,
                make_expert,
                dtype,
                tp,
            )
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
        attn = self.self_attn
        qkv, residual = attn.qkv_proj.after_norm(hidden_states, residual, self.input_layernorm)
        hidden_states = attn.o_proj(attn.attend(qkv, *rope, ctx))  # (num_tokens, hidden_size)
        normed, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(normed), residual


class MoECausalLM(DecoderForCausalLM):
    """A causal LM whose mixtures' experts arrive per expert (HF checkpoints) or stacked (a
    GGUF file's `ffn_*_exps`, transformers 5's fused parameters): each is loaded as HF's
    per-expert names, only the experts this rank holds (layers/moe.py)."""

    def num_experts_of(self, index: int) -> int | None:
        """The experts of layer `index`'s mixture; None for a dense layer."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(self._per_expert(weights))

    def _per_expert(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Stacked expert tensors as HF's per-expert names; only the experts this rank holds."""
        for name, tensor in weights:
            expert = _EXPERT.match(name)
            if expert is not None:
                if self._holds(expert.group(1), int(expert.group(2))):
                    yield name, tensor
                continue
            match = _STACKED.match(name)
            if match is None:
                yield name, tensor
                continue
            prefix, proj = match.group(1), match.group(2)
            num_experts = self.num_experts_of(int(prefix.split(".")[2]))
            assert num_experts is not None, f"{name}: experts of a dense layer"
            stacked = tensor if len(tensor.shape) == 2 else tensor.reshape(-1, tensor.shape[-1])
            rows = stacked.shape[0] // num_experts
            for e in range(num_experts):
                if not self._holds(prefix, e):
                    continue
                part = stacked.narrow(0, e * rows, rows)
                if proj == "gate_up_proj":
                    half = rows // 2
                    yield f"{prefix}.{e}.gate_proj.weight", part.narrow(0, 0, half)
                    yield f"{prefix}.{e}.up_proj.weight", part.narrow(0, half, half)
                else:
                    yield f"{prefix}.{e}.{proj}.weight", part

    def _holds(self, experts: str, e: int) -> bool:
        """Whether this rank holds expert `e` of `experts` (model.layers.N.mlp.experts)."""
        layer = int(experts.split(".")[2])
        if not self.model.start_layer <= layer < self.model.end_layer:
            return True  # another stage's: the base skips it
        mixture: Any = self.model.layers[layer].mlp
        return bool(mixture.holds(e))


class Qwen3MoeForCausalLM(MoECausalLM):
    attention_cls: type[LlamaAttention] = Qwen3Attention

    def moe_spec(self, config: Any, index: int) -> MoESpec | None:
        """Layer `index`'s mixture, HF's rule: every decoder_sparse_step-th layer not in
        mlp_only_layers; None: a dense MLP."""
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        dense = index in (getattr(config, "mlp_only_layers", None) or [])
        if dense or config.num_experts == 0 or (index + 1) % step:
            return None
        return MoESpec(
            config.num_experts,
            config.num_experts_per_tok,
            bool(config.norm_topk_prob),
            config.moe_intermediate_size,
        )

    def num_experts_of(self, index: int) -> int | None:
        spec = self.moe_spec(self.config, index)
        return None if spec is None else spec.num_experts

    def make_model(
        self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, pp: PipelineStage
    ) -> DecoderModel:
        def make_layer(index: int, cache_index: int) -> nn.Module:
            spec = self.moe_spec(hf_config, index)
            attention = self.attention_cls
            return MoEDecoderLayer(hf_config, cache_index, dtype, tp, index, attention, spec)

        return LlamaModel(hf_config, dtype, tp, pp, make_layer=make_layer)
