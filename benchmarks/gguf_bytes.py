"""Bytes a decode step reads per GGUF quant type: the file's tensor bytes against the form pagoda
keeps them in (`--quantization gguf`, the default for a GGUF file on CPU), tensor by tensor.

Every 2-D weight of the decoder layers is loaded alone into a Linear with the gguf method (as the
loader does) and its stored bytes counted (layers/quant_forms.py, stored_bytes); an untied LM
head (`output.weight`) is loaded into an LMHead as the loader does (the file's form on pagoda's
CPU kernels); a tied one, the embedding matrix, is stored as int8 rows (layers/embedding.py,
quantize_int8), counted as rows x (cols + 4). A decode step reads every layer weight and the LM
head once, so the sum is the step's weight traffic. An untied embedding matrix is only gathered
(a row a token): its int8 rows are reported apart (`embedding`), outside the sum.

    python benchmarks/gguf_bytes.py qwen2.5-coder-0.5b gemma-3-270m qwen2.5-coder-1.5b \
        --out benchmarks/results/issue40/gguf_bytes.json
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from typing import Any

import torch

from pagoda.bench.pypi_gguf import model_file
from pagoda.layers.embedding import LMHead
from pagoda.layers.gguf import GGUFWeight
from pagoda.layers.linear import Linear
from pagoda.layers.quant import make_method
from pagoda.layers.quant_forms import stored_bytes
from pagoda.loading.gguf_index import read_gguf_index


def measure(path: str) -> tuple[dict[str, dict[str, int]], dict[str, Any]]:
    """({qtype: {"tensors", "file_bytes", "stored_bytes"}} over the 2-D weights a decode step
    reads, the untied embedding's {"type", "file_bytes", "stored_bytes"} or {})."""
    method = make_method("gguf", {})
    assert method is not None
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    tensors = read_gguf_index(path).tensors
    tied = all(t.name != "output.weight" for t in tensors)
    embedding: dict[str, Any] = {}
    for tensor in tensors:
        if len(tensor.shape) != 2 or not tensor.name.endswith(".weight"):
            continue  # norms and biases: float vectors, read as they are
        qtype = tensor.tensor_type.name
        cols, rows = int(tensor.shape[0]), int(tensor.shape[1])
        if tensor.name == "token_embd.weight" and not tied:
            embedding = {"type": qtype, "file_bytes": int(tensor.data.nbytes)}
            embedding["stored_bytes"] = rows * (cols + 4)  # int8 rows and a float32 scale each
            continue
        if tensor.name == "token_embd.weight":
            kept = rows * (cols + 4)
        elif tensor.name == "output.weight":
            head = LMHead(rows, cols, torch.float32)
            head.load(_raw(tensor, qtype, rows, cols), "lm_head.weight")  # the loader's name
            head.quantize_int8()
            kept = stored_bytes(head)
        else:
            linear = Linear(cols, rows, False, torch.float32)
            linear.set_quant_method(method)
            linear.load("weight", _raw(tensor, qtype, rows, cols), None)
            linear.finalize()
            kept = stored_bytes(linear)
        entry = out[qtype]
        entry["tensors"] += 1
        entry["file_bytes"] += int(tensor.data.nbytes)
        entry["stored_bytes"] += kept
    return {k: dict(v) for k, v in out.items()}, embedding


def _raw(tensor: Any, qtype: str, rows: int, cols: int) -> Any:
    """The 2-D tensor as the loader hands it over with --quantization gguf (loading/gguf.py,
    iter_gguf): F32 as float32, every other type as its blocks."""
    if qtype == "F32":
        return torch.from_numpy(tensor.data.astype("float32").reshape(rows, cols))
    return GGUFWeight(qtype, tensor.data.reshape(rows, -1), (rows, cols))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "models", nargs="+", help="names of pagoda.bench.pypi_gguf.FILES, or paths of .gguf files"
    )
    parser.add_argument(
        "--out", default=None, help="JSON path (default: none, the table is printed only)"
    )
    args = parser.parse_args()
    result: dict[str, Any] = {
        "method": (
            "each 2-D weight of the file loaded alone through the gguf quantization method and "
            "its stored bytes counted; an untied LM head through the loader's LMHead (the file's "
            "form on pagoda's CPU kernels), a tied one as int8 rows; the sum is what a decode "
            "step reads; an untied embedding (int8 rows, gathered a row a token) apart"
        ),
        "files": {},
    }
    for name in args.models:
        path = str(model_file(name)[0])
        types, embedding = measure(path)
        file_total = sum(t["file_bytes"] for t in types.values())
        kept_total = sum(t["stored_bytes"] for t in types.values())
        result["files"][os.path.basename(name)] = {
            "file": os.path.basename(path),
            "types": types,
            "file_MiB": round(file_total / 2**20, 1),
            "stored_MiB": round(kept_total / 2**20, 1),
            "ratio": round(kept_total / file_total, 3),
            "embedding": embedding,
        }
        print(
            f"{name}: file {file_total / 2**20:.1f} MiB -> kept {kept_total / 2**20:.1f} MiB; embedding apart: {embedding}"
        )
        for qtype, t in sorted(types.items()):
            ratio = t["stored_bytes"] / t["file_bytes"]
            print(
                f"  {qtype:6s} {t['tensors']:4d} tensors  file {t['file_bytes'] / 2**20:8.1f} "
                f"MiB  kept {t['stored_bytes'] / 2**20:8.1f} MiB  x{ratio:.2f}"
            )
    if args.out is None:  # a committed result is rewritten only when named
        return
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
