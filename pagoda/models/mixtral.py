"""Mixtral: the Llama decoder (with Mistral's window where the config sets one) whose every MLP
is a sparse mixture (qwen3_moe.py's layer): `num_local_experts` experts of `intermediate_size`,
top-k renormalized. Its checkpoint names them block_sparse_moe.experts.E.w1 / w3 / w2 (gate, up,
down), renamed to HF's Llama names as they load."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from pagoda.models.family import ModelFamily
from pagoda.models.llama import LlamaAttention
from pagoda.models.qwen3_moe import MOE_GGUF_LAYER_NAMES, MoESpec, Qwen3MoeForCausalLM

FAMILY = ModelFamily(
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    # llama.cpp writes Mixtral as its "llama" architecture with experts
    gguf_archs=("llama",),
    gguf_requires="expert_count",
    gguf_permute_qk=True,
    gguf_layer_names=MOE_GGUF_LAYER_NAMES,
    gguf_config_fields={
        "expert_count": "num_local_experts",
        "expert_used_count": "num_experts_per_tok",
    },
    gguf_config_values={"model_type": "mixtral"},
)

_NAMES = {
    ".block_sparse_moe.": ".mlp.",
    ".w1.": ".gate_proj.",
    ".w3.": ".up_proj.",
    ".w2.": ".down_proj.",
}


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    attention_cls = LlamaAttention

    def moe_spec(self, config: Any, index: int) -> MoESpec | None:
        num_experts, top_k = config.num_local_experts, config.num_experts_per_tok
        return MoESpec(num_experts, top_k, True, config.intermediate_size)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(self._renamed(weights))

    @staticmethod
    def _renamed(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            for old, new in _NAMES.items():
                name = name.replace(old, new)
            yield name, tensor
