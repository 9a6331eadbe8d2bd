"""The one form every LoRA adapter file is read into (loading/lora.py: PEFT folders,
loading/lora_gguf.py: llama.cpp's GGUF LoRA): per HF module, A (r, in) and B (out, r), float32,
with the module's scaling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LoRAAdapter:
    """A loaded adapter. `weights` maps an HF module name ("model.layers.3.self_attn.q_proj")
    to (A (r, in), B (out, r)); `scaling` maps the same names to the factor B A x is scaled
    by (alpha / r, or alpha / sqrt(r) with rsLoRA)."""

    path: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: dict[str, float]
    base_model_name: str | None = None
    architecture: str | None = None  # a GGUF adapter's general.architecture
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max((a.shape[0] for a, _ in self.weights.values()), default=0)
