"""One table per model family: which HF architectures its class serves and how GGUF files name
its tensors. Each model file declares its FAMILY; models/__init__.py lists them (the registry).
Plain data: the loader (loading/hf_config.py, loading/gguf.py) reads these, never a model class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# GGUF tensor name (global, without ".weight"/".bias") -> HF module name, for every family
GGUF_GLOBAL_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
    }
)
# GGUF per-layer tensor name (blk.N.<name>) -> HF name under model.layers.N, Llama's layout;
# a family adds or overrides entries in its `gguf_layer_names`, where a name with its suffix
# (exp_probs_b.bias) maps to the whole HF parameter name
GGUF_LAYER_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
)
# GGUF metadata (<arch>.<key>) every architecture states -> config attribute: what a config
# pagoda builds itself (ModelFamily.gguf_model_type) reads besides the family's own fields
GGUF_CONFIG_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "context_length": "max_position_embeddings",
        "block_count": "num_hidden_layers",
        "embedding_length": "hidden_size",
        "feed_forward_length": "intermediate_size",
        "attention.head_count": "num_attention_heads",
        "attention.layer_norm_rms_epsilon": "rms_norm_eps",
        "vocab_size": "vocab_size",
    }
)
# GGUF tensors the models derive from the config instead (llama3 and longrope rope factors)
GGUF_SKIPPED = frozenset({"rope_freqs", "rope_factors_long", "rope_factors_short"})


@dataclass(frozen=True)
class ModelFamily:
    # HF `config.architectures` names served by the family's class (the first is its own)
    architectures: tuple[str, ...]
    # HF `model_type`s of configs that carry no `architectures` (those read from a GGUF file)
    model_types: tuple[str, ...] = ()
    # GGUF `general.architecture` values of the family's files
    gguf_archs: tuple[str, ...] = ()
    # per-layer GGUF names beyond (or replacing) GGUF_LAYER_NAMES
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    # llama.cpp interleaves q/k rows of its "llama" architecture (loading/gguf.py, unpermute_qk)
    gguf_permute_qk: bool = False
    # llama.cpp stores RMSNorm weights plus this (Gemma's (1 + w) norms: 1.0); subtracted on
    # load, so the model sees the HF checkpoint's values
    gguf_norm_shift: float = 0.0
    # GGUF metadata (<arch>.<key>) -> config attribute, where transformers' conversion drops it
    gguf_config_fields: Mapping[str, str] = field(default_factory=dict)
    # config values llama.cpp assumes for the architecture (not in its files)
    gguf_config_values: Mapping[str, Any] = field(default_factory=dict)
    # a metadata key (<arch>.<key>) only this family's files of a shared architecture hold:
    # llama.cpp's "llama" files with experts are Mixtral's
    gguf_requires: str | None = None
    # config values llama.cpp derives from a file's metadata by the family's own rule:
    # (metadata, architecture) -> {attribute: value}
    gguf_config_rule: Callable[[Mapping[str, Any], str], dict[str, Any]] | None = None
    # the transformers model_type a file's config is built as by pagoda alone (GGUF_CONFIG_NAMES
    # and the fields, values and rule above), for an architecture transformers' GGUF conversion
    # does not read (DeepSeek-V3's deepseek2); its tokenizer then comes from the file's
    # vocabulary alone (loading/tokenizer.py)
    gguf_model_type: str | None = None

    def layer_names(self) -> Mapping[str, str]:
        return {**GGUF_LAYER_NAMES, **self.gguf_layer_names}
