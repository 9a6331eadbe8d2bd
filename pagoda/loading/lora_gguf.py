"""llama.cpp's GGUF LoRA adapters (the output of its `convert_lora_to_gguf.py`), read into
pagoda's adapter form (loading/lora_adapter.py).

The file, as llama.cpp writes it and reads it (`src/llama-adapter.cpp`):
- metadata: general.type "adapter", adapter.type "lora", general.architecture (the base
  model's), adapter.lora.alpha (float32; a file without it reads as 0); an activated LoRA adds
  adapter.alora.invocation_tokens;
- per adapted weight, two tensors named after the base weight's GGUF name:
  `blk.3.attn_q.weight.lora_a`, GGUF shape (in, r): PEFT's A (r, in), row by row;
  `blk.3.attn_q.weight.lora_b`, GGUF shape (r, out): PEFT's B (out, r);
  F32, F16, BF16 or Q8_0 (the converter's --outtype; a tensor whose rows Q8_0 cannot hold
  falls back to F16);
- `*_norm.weight` tensors (mergekit-extract-lora's norms), which llama.cpp ignores: so does
  pagoda.

The scale is llama.cpp's: alpha / r (r: lora_b's ne0), or 1 when alpha is 0. The converter
writes PEFT's lora_alpha alone, so an rsLoRA adapter (alpha / sqrt(r) in PEFT) gets alpha / r
here, as in llama.cpp.

For the architectures whose q/k rows llama.cpp interleaves (ModelFamily.gguf_permute_qk;
loading/gguf.py, `unpermute_qk`), the converter permutes the adapter's q_proj / k_proj output
rows as it does the base weight's: B's rows (out), with the query and the key-value head counts;
A is left as it is. The file does not state the head counts, so the caller passes the base
model's (`heads`) and B's rows are put back in HF's order here: the adapter returned is in HF's
layout whatever the file's architecture.

Not served (ValueError): embedding adapters (token_embd, whose A and B llama.cpp flips), stacked
experts (3-D tensors), activated LoRA (the adapter applies only after its invocation tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from pagoda.loading.gguf import gguf_to_hf_name, unpermute_qk
from pagoda.loading.gguf_index import GGUFTensor, read_gguf_index
from pagoda.loading.lora_adapter import LoRAAdapter
from pagoda.models import gguf_family
from pagoda.models.family import ModelFamily

ALPHA = "adapter.lora.alpha"
INVOCATION_TOKENS = "adapter.alora.invocation_tokens"
# the types convert_lora_to_gguf.py writes (--outtype f32 / f16 / bf16 / q8_0)
_TYPES = ("F32", "F16", "BF16", "Q8_0")
_LORA_A, _LORA_B = ".lora_a", ".lora_b"
_PERMUTED = ("attn_q", "attn_k")  # blk.N.<name>: B's rows interleaved by the converter


def load_gguf_lora(path: str, heads: tuple[int, int] | None = None) -> LoRAAdapter:
    """The adapter in the GGUF file at `path`; ValueError for a file that is not a LoRA adapter
    of an architecture pagoda serves, or is malformed. `heads`: the base model's
    (num_attention_heads, num_key_value_heads), needed when the file's architecture permutes
    q/k rows and the adapter targets q_proj or k_proj (ValueError without it)."""
    try:
        index = read_gguf_index(path, arrays=(INVOCATION_TOKENS,))
    except (ValueError, OSError) as e:
        raise ValueError(f"LoRA adapter {path!r} is not a readable GGUF file: {e}") from e
    arch, family = _check_metadata(path, index.fields)
    alpha = float(index.fields.get(ALPHA, 0.0))
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    scaling: dict[str, float] = {}
    for base, (tensor_a, tensor_b) in sorted(_pairs(path, index.tensors).items()):
        module = _module_name(path, base, family)
        a, b = _dense(path, tensor_a), _dense(path, tensor_b)
        if a.shape[0] != b.shape[1]:
            raise ValueError(
                f"LoRA adapter {path!r}: {base} has lora_a of GGUF shape {tensor_a.shape} and "
                f"lora_b of {tensor_b.shape}, not (in, r) and (r, out)"
            )
        kind = base.split(".")[2] if base.startswith("blk.") else ""
        if family.gguf_permute_qk and kind in _PERMUTED:
            b = _hf_rows(path, base, b, heads, query=kind == "attn_q")
        weights[module] = (a, b)
        scaling[module] = alpha / a.shape[0] if alpha != 0 else 1.0
    if not weights:
        raise ValueError(f"LoRA adapter {path!r} holds no lora_a / lora_b tensors")
    return LoRAAdapter(path, weights, scaling, architecture=arch, extra={"alpha": alpha})


def _check_metadata(path: str, fields: Mapping[str, Any]) -> tuple[str, ModelFamily]:
    """(general.architecture, pagoda's family of it), once the file is known for a LoRA."""
    kind, adapter_type = fields.get("general.type"), fields.get("adapter.type")
    if kind != "adapter":
        raise ValueError(
            f"{path!r} is not a LoRA adapter: its general.type is {kind!r}, not 'adapter' "
            "(a model file is given as the model, not as a LoRA)"
        )
    if adapter_type != "lora":
        raise ValueError(f"adapter {path!r} has adapter.type {adapter_type!r}; pagoda serves LoRA")
    if fields.get(INVOCATION_TOKENS):
        raise ValueError(
            f"adapter {path!r} is an activated LoRA ({INVOCATION_TOKENS}), which pagoda does "
            "not serve"
        )
    arch = fields.get("general.architecture")
    family = gguf_family(str(arch), fields) if isinstance(arch, str) else None
    if family is None:
        raise ValueError(f"LoRA adapter {path!r}: architecture {arch!r} is not one pagoda serves")
    return str(arch), family


def _pairs(path: str, tensors: list[GGUFTensor]) -> dict[str, tuple[GGUFTensor, GGUFTensor]]:
    """Base weight name ("blk.3.attn_q.weight") -> its (lora_a, lora_b)."""
    halves: dict[str, dict[str, GGUFTensor]] = {}
    for tensor in tensors:
        suffix = tensor.name[-len(_LORA_A) :]
        if suffix in (_LORA_A, _LORA_B):
            halves.setdefault(tensor.name[: -len(suffix)], {})[suffix] = tensor
        elif not tensor.name.endswith("_norm.weight"):
            raise ValueError(
                f"LoRA adapter {path!r} holds tensor {tensor.name!r}, not a .lora_a / .lora_b "
                "(nor a norm, which llama.cpp ignores)"
            )
    pairs = {}
    for base, half in halves.items():
        if set(half) != {_LORA_A, _LORA_B}:
            (present,) = half
            raise ValueError(f"LoRA adapter {path!r}: {base} has {present} only")
        pairs[base] = (half[_LORA_A], half[_LORA_B])
    return pairs


def _module_name(path: str, base: str, family: ModelFamily) -> str:
    """The HF module a base weight's GGUF name stands for ("model.layers.3.self_attn.q_proj")."""
    if base.startswith("token_embd."):
        raise ValueError(f"LoRA adapter {path!r} adapts the token embeddings: not served")
    try:
        name = gguf_to_hf_name(base, family)
    except ValueError:
        name = None
    if name is None or not name.endswith(".weight"):
        raise ValueError(
            f"LoRA adapter {path!r} adapts {base!r}, which pagoda's model of the architecture "
            "does not have"
        )
    return name.removesuffix(".weight")


def _dense(path: str, tensor: GGUFTensor) -> torch.Tensor:
    """The tensor as float32, in torch's order: (r, in) for lora_a, (out, r) for lora_b."""
    from gguf import dequantize

    qtype = tensor.tensor_type.name
    if qtype not in _TYPES:
        raise ValueError(
            f"LoRA adapter {path!r}: {tensor.name} has type {qtype}; supported: {_TYPES}"
        )
    if len(tensor.shape) != 2:
        raise ValueError(
            f"LoRA adapter {path!r}: {tensor.name} has GGUF shape {tensor.shape}, not 2-D "
            "(stacked experts' adapters are not served)"
        )
    array = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32, copy=True)
    return torch.from_numpy(array.reshape(tensor.shape[1], tensor.shape[0]))


def _hf_rows(
    path: str, base: str, b: torch.Tensor, heads: tuple[int, int] | None, query: bool
) -> torch.Tensor:
    """B with its rows put back in HF's order (module docstring)."""
    if heads is None:
        raise ValueError(
            f"LoRA adapter {path!r} adapts {base}, whose rows llama.cpp permutes per head: "
            "loading it needs the base model's head counts (heads)"
        )
    n_head = heads[0] if query else heads[1]
    if n_head <= 0 or b.shape[0] % (2 * n_head) != 0:
        raise ValueError(
            f"LoRA adapter {path!r}: {base}'s {b.shape[0]} output rows are not {n_head} heads "
            "of an even size (a different base model?)"
        )
    return unpermute_qk(b, n_head)
