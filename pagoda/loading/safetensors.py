"""Tensors of an HF folder's safetensors checkpoint (one file, or shards listed in
model.safetensors.index.json), streamed one at a time on CPU."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors files in {folder}; only safetensors and GGUF checkpoints are "
            "supported (convert a PyTorch .bin checkpoint with save_pretrained(safe_serialization=True))"
        )
    return [os.path.join(folder, name) for name in files]


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every safetensors file of the folder."""
    files = _safetensors_files(folder)
    with tqdm(desc="Loading safetensors", unit="tensor") as bar:
        for path in files:
            with safe_open(path, framework="pt") as f:
                keys = list(f.keys())
                bar.total = (bar.total or 0) + len(keys)
                bar.refresh()
                for name in keys:
                    yield name, f.get_tensor(name)
                    bar.update()
