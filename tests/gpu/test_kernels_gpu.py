"""Triton kernels compiled for the GPU against their torch references at the real shapes of the
benchmark models (skipped without CUDA). tests/unit runs the same kernels in the interpreter."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda.kernels.paged_cache import KVCache
from pagoda.layers.activation import SiluAndMul
from pagoda.layers.attention import write_kv_cache
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (num_heads, num_kv_heads, head_dim, hidden_size, intermediate_size)
MODELS = {
    "SmolLM2-135M": (9, 3, 64, 576, 1536),
    "Qwen3-0.6B": (16, 8, 128, 1024, 3072),
    "Llama-3.2-1B": (32, 8, 64, 2048, 8192),
}
FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("quant", [None, torch.int8, FP8], ids=["bf16", "int8", "fp8"])
@pytest.mark.parametrize("model", list(MODELS))
def test_paged_attention_real_shapes(model: str, quant: torch.dtype | None) -> None:
    from pagoda.kernels.attention import decode_num_splits
    from tests.unit.test_triton_attention import _check

    heads, kv_heads, head_dim = MODELS[model][:3]
    rng = random.Random(0)
    # 56 decodes up to 3,000 tokens, a fresh 512-token prompt and a 300-token chunk after 1,200
    # cached tokens: one mixed step of a serving engine.
    seq_lens = [rng.randint(1, 3000) for _ in range(56)] + [512, 1500]
    query_lens = [1] * 56 + [512, 300]
    _check(
        query_lens,
        seq_lens,
        dtype=torch.bfloat16,
        quant=quant,
        block_size=16,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_splits=decode_num_splits(56, kv_heads, 4096 // 16),
    )


@pytest.mark.parametrize("model", list(MODELS))
def test_elementwise_kernels_real_shapes(model: str) -> None:
    from pagoda.kernels.activation import silu_and_mul
    from pagoda.kernels.norm import fused_add_rms_norm
    from pagoda.kernels.rotary import rotary_qk

    heads, kv_heads, head_dim, hidden, inter = MODELS[model]
    tokens, dtype, dev = 4096, torch.bfloat16, "cuda"
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, dtype=dtype, device=dev)
    residual = torch.randn_like(x)
    norm = RMSNorm(hidden, 1e-5, dtype).to(dev)
    norm.weight.data.uniform_(0.5, 1.5)
    out, h = fused_add_rms_norm(x, residual, norm.weight, 1e-5)
    want_out, want_h = norm(x, residual)
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)
    torch.testing.assert_close(out, want_out, atol=2e-2, rtol=1e-2)

    gate_up = torch.randn(tokens, 2 * inter, dtype=dtype, device=dev)
    torch.testing.assert_close(silu_and_mul(gate_up), SiluAndMul()(gate_up), atol=2e-2, rtol=1e-2)

    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}  # fmt: skip
    rope = RotaryEmbedding(head_dim, 32768, compute_inv_freq(params, head_dim)).to(dev)
    positions = torch.randint(0, 32768, (tokens,), device=dev)
    cos, sin = rope.cos_sin(positions, dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=dev)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q, want_k, want_v = apply_rotary(q, cos, sin, head_dim), apply_rotary(k, cos, sin, head_dim), v.clone()  # fmt: skip
    rotary_qk(q, k, cos, sin, head_dim)
    torch.testing.assert_close(q, want_q, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k, want_k, atol=1e-2, rtol=1e-2)
    assert torch.equal(v, want_v)


@pytest.mark.parametrize("quant", [None, torch.int8, FP8], ids=["bf16", "int8", "fp8"])
def test_write_kv_cache_real_shapes(quant: torch.dtype | None) -> None:
    from pagoda.kernels.kv_cache import write_kv_cache as write_triton

    num_blocks, block_size, kv_heads, head_dim, tokens = 4096, 16, 8, 128, 4096
    caches = [
        KVCache.allocate(num_blocks, block_size, kv_heads, head_dim, torch.bfloat16, quant, "cuda")
        for _ in range(2)
    ]
    k = torch.randn(tokens, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
    write_kv_cache(k, v, caches[0], slots)
    write_triton(k, v, caches[1], slots)
    for want, got in zip(caches[0].tensors(), caches[1].tensors()):
        if want.dtype == FP8:
            want, got = want.float(), got.float()
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("quant", [None, torch.int8, FP8], ids=["bf16", "int8", "fp8"])
@pytest.mark.parametrize("model", list(MODELS))
def test_rotary_write_kv_cache_real_shapes(model: str, quant: torch.dtype | None) -> None:
    """The fused launch against rotary_qk then write_kv_cache, compiled: bit-exact; with
    Qwen3's per-head q/k norm, against rms_norm then the two, within the norm's rounding."""
    from pagoda.kernels.kv_cache import write_kv_cache as write_triton
    from pagoda.kernels.norm import rms_norm
    from pagoda.kernels.rotary import rotary_qk
    from pagoda.kernels.rotary_kv_cache import rotary_write_kv_cache

    heads, kv_heads, head_dim = MODELS[model][:3]
    num_blocks, block_size, tokens, dtype, dev = 512, 16, 4096, torch.bfloat16, "cuda"
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim, 32768, compute_inv_freq({"rope_type": "default", "rope_theta": 1e6}, head_dim)).to(dev)  # fmt: skip
    cos, sin = rope.cos_sin(torch.randint(0, 32768, (tokens,), device=dev), dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=dev)
    slots = torch.randperm(num_blocks * block_size, device=dev)[:tokens]
    slots[::7] = -1  # padding rows
    norm = None
    if model.startswith("Qwen3"):
        w_q, w_k = (torch.empty(head_dim, dtype=dtype, device=dev).uniform_(0.5, 1.5) for _ in "qk")
        norm = (w_q, w_k, 1e-6)
    caches = [
        KVCache.allocate(num_blocks, block_size, kv_heads, head_dim, dtype, quant, dev)
        for _ in range(2)
    ]
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    want_q, want_k, want_v = qkv.clone().split(sizes, dim=-1)
    if norm is not None:
        want_q = rms_norm(want_q.reshape(-1, head_dim), norm[0], 1e-6).view(tokens, -1)
        want_k = rms_norm(want_k.reshape(-1, head_dim), norm[1], 1e-6).view(tokens, -1)
    rotary_qk(want_q, want_k, cos, sin, head_dim)
    write_triton(want_k.view(tokens, kv_heads, head_dim), want_v.view(tokens, kv_heads, head_dim), caches[0], slots)  # fmt: skip
    q, k, v = (x.view(tokens, -1, head_dim) for x in qkv.split(sizes, dim=-1))
    rotary_write_kv_cache(q, k, v, cos, sin, caches[1], slots, norm)
    exact = norm is None
    tol = {"atol": 0, "rtol": 0} if exact else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(q.flatten(1), want_q, **tol)
    if exact or quant is None:
        for want, got in zip(caches[0].tensors(), caches[1].tensors()):
            torch.testing.assert_close(got.float(), want.float(), **tol)
        return
    # Quantized with the norm: v as before; a k code may move one step where the norm moved
    # its element an ulp (int8: one scale; fp8 e4m3: 2**-3 relative).
    want, got = caches
    assert torch.equal(got.v.view(torch.uint8), want.v.view(torch.uint8))
    assert want.v_scale is not None and torch.equal(got.v_scale, want.v_scale)
    assert want.k_scale is not None and got.k_scale is not None
    deq_want = want.k.float() * want.k_scale.unsqueeze(-1)
    deq_got = got.k.float() * got.k_scale.unsqueeze(-1)
    step = float(want.k_scale.max())
    torch.testing.assert_close(deq_got, deq_want, atol=2 * step, rtol=0.13)
