"""bench latency's roofline line (pagoda/bench/roofline.py): the weight bytes a decode step reads
count a layer's stored form, the vocabulary matrix once (and only where the LM head reads it),
norms and biases in full."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFWriter
from torch import nn

from pagoda.bench.roofline import (
    decode_weight_bytes,
    file_decode_bytes,
    read_bandwidth_gb_s,
    roofline_line,
)
from pagoda.layers.embedding import LMHead, VocabEmbedding


class _KernelLinear(nn.Module):
    """A layer in the CPU kernels' 4-bit form (as cpu_forms.set_cpu_q4 leaves it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("packed", torch.zeros(4, 2, 320, dtype=torch.uint8))
        self.kernel = "cpu_q4"


class _Model(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = VocabEmbedding(100, 64)
        self.proj = _KernelLinear()
        self.norm = nn.Module()
        self.norm.register_parameter("weight", nn.Parameter(torch.ones(64)))
        self.head = LMHead(100, 64)
        if tied:
            self.head.tie_to(self.embed)


def test_a_decode_step_reads_the_kernel_form_and_the_head_once() -> None:
    vocab = 100 * 64 * 4
    kernel_form, norm = 4 * 2 * 320, 64 * 4
    assert decode_weight_bytes(_Model(tied=True)) == vocab + kernel_form + norm
    # untied: the head's own matrix; the embedding gives one row a token
    assert decode_weight_bytes(_Model(tied=False)) == vocab + kernel_form + norm


def test_the_line_reads_as_a_share_of_the_bandwidth() -> None:
    assert read_bandwidth_gb_s(torch.device("cpu"), gib=1 / 64, tries=2) > 0
    line = roofline_line(
        {
            "bytes_per_step_mb": 100.0,
            "decode_weight_mb": 90.0,
            "decode_kv_mb": 10.0,
            "decode_ms_per_token": 10.0,
            "read_gb_s": 10.0,
            "machine_read_bandwidth_gb_s": 40.0,
            "fraction_of_bandwidth": 0.25,
            "bandwidth_bound_tok_s": 400.0,
        }
    )
    assert "25% of the 40.0 GB/s" in line and "100.0 MB a decode step" in line


def _gguf(path: Path, tensors: dict[str, np.ndarray]) -> str:
    writer = GGUFWriter(str(path), "llama")
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_the_file_s_bytes_count_the_embedding_only_where_the_head_reads_it(tmp_path: Path) -> None:
    """A GGUF's decode bytes are its tensors' bytes as stored; an untied file's token embedding
    is gathered a row a token, so it is left out."""
    embd = np.zeros((100, 64), dtype=np.float16)  # 12,800 bytes
    layer = {"blk.0.attn_q.weight": np.zeros((64, 64), dtype=np.float32)}  # 16,384 bytes
    norm = {"output_norm.weight": np.ones(64, dtype=np.float32)}  # 256 bytes
    tied = _gguf(tmp_path / "tied.gguf", {"token_embd.weight": embd, **layer, **norm})
    assert file_decode_bytes(tied) == 12_800 + 16_384 + 256
    head = {"output.weight": np.zeros((100, 64), dtype=np.float32)}  # 25,600 bytes
    untied = _gguf(tmp_path / "untied.gguf", {"token_embd.weight": embd, **layer, **norm, **head})
    assert file_decode_bytes(untied) == 16_384 + 256 + 25_600
