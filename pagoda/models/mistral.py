"""Mistral: the Llama decoder with a sliding attention window on every layer where its config
sets `sliding_window` (model_config.py, sliding_window_of); everything else is llama.py's."""

from __future__ import annotations

from pagoda.models.family import ModelFamily
from pagoda.models.llama import LlamaForCausalLM

FAMILY = ModelFamily(
    architectures=("MistralForCausalLM",), model_types=("mistral",), gguf_archs=("mistral",)
)


class MistralForCausalLM(LlamaForCausalLM):
    pass
