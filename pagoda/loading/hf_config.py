"""The transformers config of a checkpoint (an HF folder's config.json, or derived from a GGUF
file's metadata and cached, see pagoda/loading/model_files.py) and what is read from it:
the architecture names and the longest sequence it supports."""

from __future__ import annotations

import os
from typing import Any

from transformers import AutoConfig

from pagoda.loading.model_files import gguf_cache_dir, save_to_cache

# GGUF configs carry no `architectures`; their model_type picks the class.
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def load_hf_config(folder: str, gguf_file: str | None, trust_remote_code: bool = False) -> Any:
    """The transformers config of an HF folder, or of a GGUF file (cached, see model_files)."""
    if gguf_file is None:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    cached = gguf_cache_dir("configs", os.path.join(folder, gguf_file))
    if os.path.isfile(os.path.join(cached, "config.json")):
        return AutoConfig.from_pretrained(cached)
    hf_config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    save_to_cache(hf_config.save_pretrained, cached)
    return hf_config


def architecture_of(hf_config: Any) -> list[str]:
    """The checkpoint's HF architecture names (GGUF configs: derived from model_type)."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures and hf_config.model_type in _ARCH_BY_MODEL_TYPE:
        architectures = [_ARCH_BY_MODEL_TYPE[hf_config.model_type]]
    return architectures or [f"<model_type {hf_config.model_type}>"]


def max_positions(hf_config: Any) -> int:
    """Longest sequence the checkpoint supports exactly: max_position_embeddings, or the
    sliding window where one applies (pagoda attends to the full context)."""
    limit = int(hf_config.max_position_embeddings)
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if window and (layer_types is None or "sliding_attention" in layer_types):
        limit = min(limit, int(window))
    return limit
