"""Random LoRA adapters saved by PEFT itself, and HF transformers with PEFT as their oracle.

`save_adapter` builds a PEFT LoRA over a tiny base checkpoint (tests/conftest.py's
tiny_model_dir) with random A and B (PEFT starts B at zero, which would change nothing) and
saves it as PEFT does (`adapter_config.json` + `adapter_model.safetensors`). `peft_model`
loads base + adapter the way a PEFT user runs it: the strict float32 oracle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return _save_random_lora(base, out_dir, spec, std)


def save_adapter_for_config(
    config: object, out_dir: str, spec: AdapterSpec, std: float = 0.2
) -> str:
    """The same adapter for a base known by its HF config only (a GGUF model's): PEFT builds it
    over a randomly initialised model of that config (the adapter holds only A and B)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _save_random_lora(base, out_dir, spec, std)


def _save_random_lora(base: torch.nn.Module, out_dir: str, spec: AdapterSpec, std: float) -> str:
    from peft import LoraConfig, get_peft_model

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


def lora_scores(llm: Any, ids: list[int], lora: Any) -> tuple[list[int], list[float]]:
    """(most likely next token, log p(actual next token)) at every position after the first,
    with adapter `lora` (tests/models/test_quant_quality.py's `score`, under an adapter)."""
    from pagoda import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False, lora_request=lora)
    assert out[0].prompt_logprobs is not None
    top1, actual = [], []
    for pos, token in zip(out[0].prompt_logprobs[1:], ids[1:]):
        assert pos is not None
        top1.append(next(t for t, lp in pos.items() if lp.rank == 1))
        actual.append(pos[token].logprob)
    return top1, actual


def peft_model(base_dir: str, adapter_dir: str) -> torch.nn.Module:
    """HF transformers + PEFT on the same base and adapter, float32, eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()
