"""Model registry: HF architecture name (config.architectures) -> pagoda model class."""

from __future__ import annotations

from pagoda.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from pagoda.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architectures: list[str]) -> type[LlamaForCausalLM]:
    """The class of the first supported architecture in a checkpoint's `architectures`."""
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"model architecture {architectures} is not supported; "
        f"supported architectures: {', '.join(MODEL_REGISTRY)}"
    )
