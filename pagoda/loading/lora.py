"""LoRA adapter files, read into one form (LoRAAdapter, loading/lora_adapter.py): per HF
module, A (r, in) and B (out, r), float32, with the module's scaling.

Two formats:
- a PEFT folder: `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `rank_pattern`,
  `alpha_pattern`, `target_modules`) and `adapter_model.safetensors`, tensors named
  `base_model.model.<HF module>.lora_A.weight` / `.lora_B.weight`;
- llama.cpp's GGUF LoRA (`convert_lora_to_gguf.py`): loading/lora_gguf.py.

What the model can take (targets it has, shapes, the rank bound) is checked where the adapter
meets the model (runner/lora.py), so a bad adapter is a ValueError and a running engine stays
up.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import torch

from pagoda.loading.lora_adapter import LoRAAdapter

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def load_adapter(path: str, heads: tuple[int, int] | None = None) -> LoRAAdapter:
    """A PEFT folder or a GGUF LoRA file; ValueError when it is neither or is malformed.
    `heads`: the base model's (num_attention_heads, num_key_value_heads), which a GGUF
    adapter's q/k of the architectures llama.cpp permutes needs (loading/lora_gguf.py)."""
    if not isinstance(path, str) or not path:
        raise ValueError("a LoRA adapter needs a path (lora_path)")
    if os.path.isfile(path) and path.endswith(".gguf"):
        from pagoda.loading.lora_gguf import load_gguf_lora

        return load_gguf_lora(path, heads)
    if os.path.isdir(path):
        return load_peft(path)
    raise ValueError(
        f"LoRA adapter {path!r} not found: give a PEFT folder (adapter_config.json + "
        "adapter_model.safetensors) or a GGUF LoRA file"
    )


def _read_config(folder: str) -> dict[str, Any]:
    config_path = os.path.join(folder, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {folder!r} has no {ADAPTER_CONFIG}")
    with open(config_path) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"adapter {folder!r} is a {peft_type} adapter; pagoda serves LoRA only")
    if config.get("use_dora"):
        raise ValueError(f"adapter {folder!r} uses DoRA, which pagoda does not serve")
    if config.get("bias", "none") not in (None, "none"):
        raise ValueError(f"adapter {folder!r} trains biases (bias={config['bias']!r}): not served")
    if config.get("modules_to_save"):
        raise ValueError(
            f"adapter {folder!r} saves whole modules ({config['modules_to_save']}): not served"
        )
    return config


def _read_tensors(folder: str) -> dict[str, torch.Tensor]:
    for name in ADAPTER_WEIGHTS:
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return dict(load_file(file))
        loaded = torch.load(file, map_location="cpu", weights_only=True)
        return dict(loaded)
    raise ValueError(f"LoRA adapter {folder!r} has no {' or '.join(ADAPTER_WEIGHTS)}")


_PEFT_NAME = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the value of the first key the module name ends
    with (keys are regexes or name suffixes)."""
    for key, value in patterns.items():
        if module == key or module.endswith("." + key) or re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def load_peft(folder: str) -> LoRAAdapter:
    config = _read_config(folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in _read_tensors(folder).items():
        match = _PEFT_NAME.match(name)
        if match is None:
            raise ValueError(f"adapter {folder!r} holds tensor {name!r}, which is not a LoRA A/B")
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    scaling: dict[str, float] = {}
    rank = int(config.get("r", 8))
    alpha = float(config.get("lora_alpha", rank))
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {folder!r}: {module} has lora_{list(ab)[0]} only")
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"adapter {folder!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                "not (r, in) and (out, r)"
            )
        r = int(_pattern_value(config.get("rank_pattern") or {}, module, rank))
        module_alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, alpha))
        if r != a.shape[0]:
            raise ValueError(f"adapter {folder!r}: {module} has rank {a.shape[0]}, config says {r}")
        root = math.sqrt(r) if config.get("use_rslora") else r
        weights[module] = (a, b)
        scaling[module] = module_alpha / root
    if not weights:
        raise ValueError(f"adapter {folder!r} holds no LoRA tensors")
    return LoRAAdapter(folder, weights, scaling, config.get("base_model_name_or_path"))
