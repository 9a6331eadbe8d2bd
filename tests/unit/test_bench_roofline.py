"""bench latency's roofline line (pagoda/bench/roofline.py): the weight bytes a decode step reads
count a layer's stored form, the vocabulary matrix once (and only where the LM head reads it),
norms and biases in full."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.bench.roofline import decode_weight_bytes, read_bandwidth_gb_s, roofline_line
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
