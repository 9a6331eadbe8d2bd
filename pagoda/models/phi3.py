"""Phi-3 / Phi-4-mini: the Llama decoder whose checkpoint holds q/k/v and gate/up fused
(`qkv_proj`, `gate_up_proj`; GGUF `attn_qkv`, `ffn_up`), cut back into HF's projections as they
load. Partial rotary (Phi-4-mini) and longrope scaling are llama.py's and layers/rotary.py's; a
sliding window where the config sets one (Phi-3-mini-4k) is model_config.py's."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from pagoda.model_config import head_dim_of
from pagoda.models.family import ModelFamily
from pagoda.models.llama import LlamaForCausalLM

FAMILY = ModelFamily(
    architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    gguf_archs=("phi3",),
    gguf_layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
)


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The fused tensors as HF's separate projections (rows: q | k | v, gate | up)."""
        cfg = self.config
        head_dim = head_dim_of(cfg)
        q = cfg.num_attention_heads * head_dim
        kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
        inter = cfg.intermediate_size
        for name, tensor in weights:
            if ".self_attn.qkv_proj." in name:
                for proj, start, rows in (
                    ("q_proj", 0, q),
                    ("k_proj", q, kv),
                    ("v_proj", q + kv, kv),
                ):
                    yield name.replace(".qkv_proj.", f".{proj}."), tensor.narrow(0, start, rows)
            elif ".mlp.gate_up_proj." in name:
                for proj, start in (("gate_proj", 0), ("up_proj", inter)):
                    yield (
                        name.replace(".gate_up_proj.", f".{proj}."),
                        tensor.narrow(0, start, inter),
                    )
            else:
                yield name, tensor
