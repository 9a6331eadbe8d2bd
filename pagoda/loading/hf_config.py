"""The config of a checkpoint (an HF folder's config.json through transformers, or derived from a
GGUF file's metadata once and cached, see pagoda/loading/model_files.py) and what is read from
it: the longest sequence it supports (the architecture names: models/__init__.py)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

from pagoda.loading.model_files import gguf_cache_dir, save_to_cache


class GGUFConfig(SimpleNamespace):
    """The config of a GGUF file: every field of the transformers config it converts to (class
    defaults included), as attributes. Read back from the cache without importing transformers,
    whose config classes take a second or two to import."""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def load_hf_config(folder: str, gguf_file: str | None, trust_remote_code: bool = False) -> Any:
    """The transformers config of an HF folder, or the GGUFConfig of a GGUF file (cached)."""
    if gguf_file is None:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    cached = gguf_cache_dir("configs", os.path.join(folder, gguf_file))
    path = None if cached is None else os.path.join(cached, "config.json")
    if path is not None and os.path.isfile(path):
        with open(path) as f:
            return GGUFConfig(**json.load(f))
    from transformers import AutoConfig

    # Every field (use_diff=False): absent ones would read as None here, not as class defaults.
    text = AutoConfig.from_pretrained(folder, gguf_file=gguf_file).to_json_string(use_diff=False)
    config = {**json.loads(text), **_family_fields(os.path.join(folder, gguf_file))}
    text = json.dumps(config, indent=2)
    save_to_cache(lambda tmp: _write(os.path.join(tmp, "config.json"), text), cached)
    return GGUFConfig(**config)


def _family_fields(path: str) -> dict[str, Any]:
    """What transformers' GGUF conversion leaves out of a family's config: the file's own
    metadata (ModelFamily.gguf_config_fields) and what llama.cpp assumes for the architecture
    (gguf_config_values)."""
    from pagoda.loading.gguf_index import read_gguf_index
    from pagoda.models import gguf_family

    index = read_gguf_index(path)
    fields = index.fields
    arch = str(fields.get("general.architecture"))
    family = gguf_family(arch, fields)
    if family is None:
        return {}
    out = dict(family.gguf_config_values)
    for key, attr in family.gguf_config_fields.items():
        value = fields.get(f"{arch}.{key}")
        if value is not None:
            out[attr] = value
    if family.gguf_config_rule is not None:
        out.update(family.gguf_config_rule(fields, arch))
    rope = _rope_parameters(index, arch)
    if rope is not None:
        out["rope_parameters"] = rope
    return out


def _rope_parameters(index: Any, arch: str) -> dict[str, Any] | None:
    """The rope a GGUF file states beyond a plain one, which transformers' conversion drops:
    Llama 3's scaling (kept by llama.cpp's converter only as the `rope_freqs` tensor, each
    frequency's divisor), longrope's factors (Phi-3.5 / Phi-4-mini: `rope_factors_short` /
    `_long` with the original context and attention factor), and a partial rotary
    (rope.dimension_count below the head size, Phi-4-mini's 3/4). None: nothing of the kind."""
    fields = index.fields
    tensors = {t.name: t for t in index.tensors}
    head_dim = fields.get(f"{arch}.attention.key_length")
    hidden, heads = (
        fields.get(f"{arch}.embedding_length"),
        fields.get(f"{arch}.attention.head_count"),
    )
    if head_dim is None and hidden and heads:
        head_dim = int(hidden) // int(heads)
    dims = fields.get(f"{arch}.rope.dimension_count")
    partial = dims is not None and head_dim is not None and int(dims) < int(head_dim)
    rope: dict[str, Any] = {"rope_theta": float(fields.get(f"{arch}.rope.freq_base") or 10000.0)}

    def values(name: str) -> list[float]:
        return [float(v) for v in tensors[name].data.reshape(-1)]

    if "rope_freqs.weight" in tensors:
        rope |= {"rope_type": "freq_factors", "freq_factors": values("rope_freqs.weight")}
    elif "rope_factors_long.weight" in tensors:
        rope |= {
            "rope_type": "longrope",
            "short_factor": values("rope_factors_short.weight"),
            "long_factor": values("rope_factors_long.weight"),
            "original_max_position_embeddings": int(
                fields[f"{arch}.rope.scaling.original_context_length"]
            ),
            "attention_factor": float(fields[f"{arch}.rope.scaling.attn_factor"]),
        }
    elif not partial:
        return None
    else:
        rope["rope_type"] = "default"
    if partial:
        rope["partial_rotary_factor"] = int(dims) / int(head_dim)
    return rope


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def max_positions(hf_config: Any) -> int:
    """Longest sequence the checkpoint supports: max_position_embeddings (a sliding window
    limits what a layer attends to, not the sequence: layers/attention.py)."""
    return int(hf_config.max_position_embeddings)
