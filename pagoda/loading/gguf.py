"""Tensors and metadata of a GGUF file. Tensors are renamed to HF names (so models only ever see
HF names, `CausalLM.load_weights`), their q/k rows put back in HF's order, and dequantized to
float32, or kept as their blocks (GGUFWeight) for the GGUF quantization method."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from pagoda.layers.gguf import GGUFWeight
from pagoda.loading.gguf_index import read_gguf_index
from pagoda.models import gguf_family
from pagoda.models.family import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES, GGUF_SKIPPED, ModelFamily

# The types of the common GGUF files. Those without a group decoding (layers.gguf.decode) are
# dequantized by the gguf package and, in a quantized layer, re-quantized to int8 rows.
_GGUF_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
)  # fmt: skip
_GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")


def gguf_to_hf_name(gguf_name: str, family: ModelFamily | None = None) -> str | None:
    """HF parameter name of a GGUF tensor (in `family`'s layout; Llama's when None); None for
    tensors the models derive themselves."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in GGUF_SKIPPED:
        return None
    if base in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[base]}.{suffix}"
    layer_names = GGUF_LAYER_NAMES if family is None else family.layer_names()
    parts = base.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and f"{parts[2]}.{suffix}" in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[f'{parts[2]}.{suffix}']}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not supported by pagoda's models")


def unpermute_qk(tensor: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's conversion of q/k rows from HF's rotate_half layout to interleaved pairs.

    llama.cpp stores, per head, rows (0, d/2, 1, d/2+1, ...); HF wants (0, 1, ..., d/2, ...).
    """
    rows = tensor.shape[0]
    half = rows // n_head // 2
    return (
        tensor.reshape(n_head, half, 2, *tensor.shape[1:])
        .transpose(1, 2)
        .reshape(tensor.shape)
        .contiguous()
    )


def iter_gguf(path: str, raw: bool) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """(HF parameter name, tensor) for every tensor of the GGUF file the models take; with
    `raw`, quantized tensors and F16 / BF16 weights come as GGUFWeight (their blocks) instead
    of float32."""
    from gguf import dequantize

    index = read_gguf_index(path)
    fields: dict[str, Any] = index.fields
    arch = fields.get("general.architecture")
    family = gguf_family(str(arch), fields)
    if family is None:
        raise ValueError(f"GGUF architecture {arch!r} is not supported by pagoda's models")
    n_head: Any = fields.get(f"{arch}.attention.head_count")
    n_kv_head: Any = fields.get(f"{arch}.attention.head_count_kv") or n_head
    for tensor in tqdm(index.tensors, desc="Loading GGUF", unit="tensor"):
        name = gguf_to_hf_name(tensor.name, family)
        if name is None:
            continue
        qtype = tensor.tensor_type.name
        if qtype not in _GGUF_TYPES:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has type {qtype}; supported: {', '.join(_GGUF_TYPES)}"
            )
        heads = None
        if family.gguf_permute_qk and ".attn_q." in tensor.name:
            heads = int(n_head)
        elif family.gguf_permute_qk and ".attn_k." in tensor.name:
            heads = int(n_kv_head)
        # F16 / BF16 weights as they are too (F32 and the vectors, norms and biases: float32)
        if raw and (qtype not in _GGUF_FLOAT_TYPES or (qtype != "F32" and len(tensor.shape) >= 2)):
            rows = int(np.prod(tensor.shape[1:]))
            # a 3-D tensor (a mixture's experts, stacked) as rows: expert-major
            data = tensor.data.reshape(rows, -1)
            weight = GGUFWeight(qtype, data, (rows, int(tensor.shape[0])))
            if heads is not None:
                weight = weight.permute_rows(unpermute_qk(torch.arange(rows), heads))
            yield name, weight
            continue
        array = dequantize(tensor.data, tensor.tensor_type)
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, copy=True)  # a view of the read-only memory map
        dense = torch.from_numpy(array.astype(np.float32, copy=False))
        if family.gguf_norm_shift and name.endswith("norm.weight"):
            dense = dense - family.gguf_norm_shift
        yield name, dense if heads is None else unpermute_qk(dense, heads)
