"""The registry: every model family pagoda runs, one line each (its ModelFamily table, which
names its HF architectures and GGUF names, and its class). docs/adding-a-model.md walks through
adding one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagoda.models import deepseek_v3, gemma3, llama, mistral, mixtral, phi3, qwen3, qwen3_moe
from pagoda.models.base import DecoderForCausalLM
from pagoda.models.family import ModelFamily

FAMILIES: tuple[tuple[ModelFamily, type[DecoderForCausalLM]], ...] = (
    (llama.FAMILY, llama.LlamaForCausalLM),
    (mistral.FAMILY, mistral.MistralForCausalLM),
    (llama.QWEN2_FAMILY, llama.Qwen2ForCausalLM),
    (qwen3.FAMILY, qwen3.Qwen3ForCausalLM),
    (gemma3.FAMILY, gemma3.Gemma3ForCausalLM),
    (phi3.FAMILY, phi3.Phi3ForCausalLM),
    (qwen3_moe.FAMILY, qwen3_moe.Qwen3MoeForCausalLM),
    (mixtral.FAMILY, mixtral.MixtralForCausalLM),
    (deepseek_v3.FAMILY, deepseek_v3.DeepseekV3ForCausalLM),
)

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    arch: cls for family, cls in FAMILIES for arch in family.architectures
}

# Sequence classifiers (HF: the base model and a `score` Linear) run on their family's causal
# LM class; the loader adds the head (models/score_head.py).
SEQUENCE_CLASSIFIERS = (
    "LlamaForSequenceClassification",
    "MistralForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification",
)


def registered_name(arch: str) -> str:
    """The registry's name for an architecture: a supported sequence classifier's causal LM."""
    if arch in SEQUENCE_CLASSIFIERS:
        return arch.replace("ForSequenceClassification", "ForCausalLM")
    return arch


def get_model_class(architectures: list[str]) -> type[DecoderForCausalLM]:
    """The class of the first supported architecture in a checkpoint's `architectures`."""
    for arch in architectures:
        if registered_name(arch) in MODEL_REGISTRY:
            return MODEL_REGISTRY[registered_name(arch)]
    raise ValueError(
        f"model architecture {architectures} is not supported; "
        f"supported architectures: {', '.join([*MODEL_REGISTRY, *SEQUENCE_CLASSIFIERS])}"
    )


def architectures_of(hf_config: Any) -> list[str]:
    """The checkpoint's HF architecture names; a config without them (one read from a GGUF
    file) names its family by model_type."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures:
        for family, _ in FAMILIES:
            if hf_config.model_type in family.model_types:
                return [family.architectures[0]]
    return architectures or [f"<model_type {hf_config.model_type}>"]


def gguf_family(gguf_arch: str, fields: Mapping[str, Any] | None = None) -> ModelFamily | None:
    """The family of GGUF files whose general.architecture is `gguf_arch` and whose metadata is
    `fields` (None: unknown). Of the families sharing an architecture, one that requires a key
    (ModelFamily.gguf_requires) serves the files holding it, the other the rest."""
    families = [f for f, _ in FAMILIES if gguf_arch in f.gguf_archs]
    for family in families:
        key = family.gguf_requires
        if key is not None and fields is not None and f"{gguf_arch}.{key}" in fields:
            return family
    return next((f for f in families if f.gguf_requires is None), None)
