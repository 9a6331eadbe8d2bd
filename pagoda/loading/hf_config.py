"""The config of a checkpoint (an HF folder's config.json through transformers, or derived from a
GGUF file's metadata once and cached, see pagoda/loading/model_files.py) and what is read from
it: the longest sequence it supports (the architecture names: models/__init__.py)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from pagoda.loading.model_files import gguf_cache_dir, save_to_cache

if TYPE_CHECKING:
    from pagoda.models.family import ModelFamily

# tokenizer metadata -> config attribute (a config pagoda builds: ModelFamily.gguf_model_type)
_TOKEN_IDS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}


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
    path = os.path.join(folder, gguf_file)
    cached = gguf_cache_dir("configs", path)
    entry = None if cached is None else os.path.join(cached, "config.json")
    if entry is not None and os.path.isfile(entry):
        with open(entry) as f:
            return GGUFConfig(**json.load(f))
    from transformers import AutoConfig

    from pagoda.loading.gguf_index import read_gguf_index

    index = read_gguf_index(path)
    family = _family_of(index)
    if family is not None and family.gguf_model_type is not None:
        # transformers' conversion does not read the architecture: built from the metadata here
        built = AutoConfig.for_model(family.gguf_model_type, **_built_fields(index, family))
        config = json.loads(built.to_json_string(use_diff=False))
    else:
        # Every field (use_diff=False): absent ones would read as None here, not as defaults.
        converted = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
        config = {**json.loads(converted.to_json_string(use_diff=False)), **_family_fields(path)}
    text = json.dumps(config, indent=2)
    save_to_cache(lambda tmp: _write(os.path.join(tmp, "config.json"), text), cached)
    return GGUFConfig(**config)


def _family_of(index: Any) -> ModelFamily | None:
    from pagoda.models import gguf_family

    return gguf_family(str(index.fields.get("general.architecture")), index.fields)


def _built_fields(index: Any, family: ModelFamily) -> dict[str, Any]:
    """The config of a family whose files transformers does not read: what every architecture
    states (GGUF_CONFIG_NAMES; the vocabulary's size, else the embedding's rows), the special
    token ids (absent: None, not the config class's defaults), tied embeddings (no `output`
    tensor, as llama.cpp writes them), then the family's own fields."""
    from pagoda.models.family import GGUF_CONFIG_NAMES

    fields, arch = index.fields, str(index.fields.get("general.architecture"))
    out = {
        attr: fields[f"{arch}.{key}"]
        for key, attr in GGUF_CONFIG_NAMES.items()
        if f"{arch}.{key}" in fields
    }
    tensors = {t.name: t for t in index.tensors}
    if "vocab_size" not in out and "token_embd.weight" in tensors:
        out["vocab_size"] = int(tensors["token_embd.weight"].shape[1])
    out |= {attr: fields.get(key) for key, attr in _TOKEN_IDS.items()}
    out["tie_word_embeddings"] = "output.weight" not in tensors
    return out | _fields_of(index, family)


def _family_fields(path: str) -> dict[str, Any]:
    """What transformers' GGUF conversion leaves out of a family's config: the file's own
    metadata (ModelFamily.gguf_config_fields) and what llama.cpp assumes for the architecture
    (gguf_config_values)."""
    from pagoda.loading.gguf_index import read_gguf_index

    index = read_gguf_index(path)
    family = _family_of(index)
    return {} if family is None else _fields_of(index, family)


def _fields_of(index: Any, family: ModelFamily) -> dict[str, Any]:
    """`family`'s config fields of a file: its values, the metadata its table names, what its
    rule derives, and the rope the file states (unless the rule states it)."""
    fields = index.fields
    arch = str(fields.get("general.architecture"))
    out = dict(family.gguf_config_values)
    for key, attr in family.gguf_config_fields.items():
        value = fields.get(f"{arch}.{key}")
        if value is not None:
            out[attr] = value
    if family.gguf_config_rule is not None:
        out.update(family.gguf_config_rule(fields, arch))
    rope = _rope_parameters(index, arch)
    if rope is not None and "rope_parameters" not in out:
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
