"""The roofline line of `bench latency`: bytes a batch-1 decode step reads, over its time, as a
fraction of the machine's read bandwidth measured in the same run.

Bytes of a step: the weights the decode path reads (the embedding one row, unless the LM head
reads the same matrix) and the KV cache up to the request's mean length over its decode.
Norm weights and biases count; activations and the logits do not (they stay in cache). For a
GGUF model the weights are counted as the file holds them (every tensor's bytes, the token
embedding left out where an untied output matrix is the head): the bytes a decode step must
read, whatever form pagoda keeps them in; the loaded form's bytes are recorded beside them.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pagoda.layers.embedding import LMHead, VocabEmbedding


def read_bandwidth_gb_s(device: torch.device, gib: float = 1.0, tries: int = 5) -> float:
    """Best of `tries` float32 sums over `gib` GiB: the rate the device streams its memory."""
    a = torch.ones(int(gib * 2**30) // 4, device=device)
    best = float("inf")
    for _ in range(tries):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.sum().item()
        best = min(best, time.perf_counter() - t0)
    del a
    return int(gib * 2**30) / best / 1e9


def _read_by_decode(module: Any) -> list[torch.Tensor]:
    """The module's own tensors a decode step reads (not its children's)."""
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads (each tensor once, however many modules hold it)."""
    heads = [m for m in model.modules() if isinstance(m, LMHead)]
    head_matrices = {id(m._tied[0]) for m in heads if m.tied}
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, VocabEmbedding) and id(module) not in head_matrices:
            continue  # one row a token
        for t in _read_by_decode(module):
            seen[t.data_ptr()] = t.nbytes
    return sum(seen.values())


def file_decode_bytes(gguf_path: str) -> int:
    """Tensor bytes of a GGUF file that one decode step reads: all of them, but the token
    embedding when the file has its own output matrix (the embedding is then one row a token)."""
    from pagoda.loading.gguf_index import read_gguf_index

    tensors = read_gguf_index(gguf_path).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(
        int(t.data.nbytes) for t in tensors if not (untied and t.name == "token_embd.weight")
    )


def roofline(
    llm: Any,
    input_len: int,
    output_len: int,
    decode_ms_per_token: float,
    gguf_path: str | None = None,
) -> dict[str, Any]:
    """The line for the bench JSON: bytes a decode step reads and at what share of bandwidth.
    gguf_path: the model's file, whose tensor bytes are the weights counted."""
    model = llm.engine.executor.runner.model
    loaded = decode_weight_bytes(model)
    weights = file_decode_bytes(gguf_path) if gguf_path else loaded
    kv_per_token = llm.engine.model_config.kv_bytes_per_token(llm.engine.config.cache.kv_dtype)
    kv = kv_per_token * (input_len + output_len / 2)  # mean cache length over the decode
    step_bytes = weights + kv
    bandwidth = read_bandwidth_gb_s(llm.engine.device)
    achieved = step_bytes / (decode_ms_per_token / 1e3) / 1e9
    return {
        "weights_counted": "the GGUF file's tensor bytes" if gguf_path else "the loaded weights",
        "decode_weight_mb": round(weights / 1e6, 2),
        "loaded_decode_weight_mb": round(loaded / 1e6, 2),
        "decode_kv_mb": round(kv / 1e6, 2),
        "bytes_per_step_mb": round(step_bytes / 1e6, 2),
        "decode_ms_per_token": decode_ms_per_token,
        "read_gb_s": round(achieved, 2),
        "machine_read_bandwidth_gb_s": round(bandwidth, 2),
        "fraction_of_bandwidth": round(achieved / bandwidth, 3),
        "bandwidth_bound_tok_s": round(bandwidth * 1e9 / step_bytes, 1),
    }


def roofline_line(r: dict[str, Any]) -> str:
    return (
        f"roofline: {r['bytes_per_step_mb']} MB a decode step ({r['decode_weight_mb']} MB weights, "
        f"{r['decode_kv_mb']} MB KV) in {r['decode_ms_per_token']} ms: {r['read_gb_s']} GB/s, "
        f"{r['fraction_of_bandwidth']:.0%} of the {r['machine_read_bandwidth_gb_s']} GB/s measured "
        f"(bound: {r['bandwidth_bound_tok_s']} tok/s)"
    )
