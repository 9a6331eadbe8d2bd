"""Random LoRA adapters saved by PEFT itself, and HF transformers with PEFT as their oracle.

`save_adapter` builds a PEFT LoRA over a tiny base checkpoint (tests/conftest.py's
tiny_model_dir) with random A and B (PEFT starts B at zero, which would change nothing) and
saves it as PEFT does (`adapter_config.json` + `adapter_model.safetensors`). `peft_model`
loads base + adapter the way a PEFT user runs it: the strict float32 oracle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    targets: Sequence[str] = ALL_LINEAR
    use_rslora: bool = False
    seed: int = 0
    rank_pattern: dict[str, int] = field(default_factory=dict)


def save_adapter(base_dir: str, out_dir: str, spec: AdapterSpec, std: float = 0.2) -> str:
    """A PEFT LoRA adapter of `spec` over the base checkpoint, with random A and B, saved."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.use_rslora,
        rank_pattern=dict(spec.rank_pattern),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(1000 + spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(std * torch.randn(param.shape, generator=gen))
    model.save_pretrained(out_dir)
    return out_dir


def peft_model(base_dir: str, adapter_dir: str) -> torch.nn.Module:
    """HF transformers + PEFT on the same base and adapter, float32, eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def save_adapter_for_config(
    config: object, out_dir: str, spec: AdapterSpec, std: float = 0.2
) -> str:
    """The same adapter for a base known by its HF config only (a GGUF model's): PEFT builds it
    over a randomly initialised model of that config (the adapter holds only A and B)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lora = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.use_rslora,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    gen = torch.Generator().manual_seed(1000 + spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(std * torch.randn(param.shape, generator=gen))
    model.save_pretrained(out_dir)
    return out_dir
