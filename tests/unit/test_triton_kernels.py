"""Triton elementwise kernels (pagoda/kernels/{kv_cache,norm,activation,rotary}.py) against their
torch references, under the Triton interpreter when there is no GPU.

Inputs are strided views (rows wider than the tensor, as column slices of a fused projection),
sizes are not powers of two, and everything a kernel must not touch is checked unchanged.

Tolerances (measured under the interpreter, torch 2.13 CPU, over these cases and 3-4 seeds):
- write_kv_cache: float caches bit-exact. int8 / fp8 codes and float32 scales: measured bit-exact
  (0 of 1.06M codes differ, 0 scales); the assert allows an int8 code one off only where
  x / scale is within 1e-6 of a .5 tie, and a scale one ulp off. fp8 codes are asserted exact.
- rms_norm / fused_add_rms_norm: hidden bit-exact. out float32: atol = rtol = 1e-6 (measured max
  |diff| 9.5e-7, 4 ulps: reduction order and rsqrt); bf16 / fp16: within one ulp everywhere and
  bit-exact for >= 99% of elements (measured: all bit-exact).
- silu_and_mul: float32 atol = rtol = 1e-6 (measured 3 ulps, |diff| 3.8e-6 at values ~30: exp);
  bf16 / fp16 within one ulp of float32 math rounded once (measured: bit-exact) and within two
  ulps of `SiluAndMul`, which rounds silu(gate) first (measured: bf16 one ulp, fp16 two).
- rotary_qk: bit-exact in every dtype (same per-op rounding, no multiply-add fusion).
- rotary_write_kv_cache: bit-exact against rotary_qk then write_kv_cache (q, cache values and
  scales), in every dtype and KV cache dtype; float caches also bit-exact against the torch
  references (apply_rotary, then the torch write). With Qwen3's per-head q/k norm fused in,
  against rms_norm then the two: v bit-exact; q and k within 4 ulps (of the dtype's eps) of their
  head's largest element (measured float32: 88% bit-exact, at most 2.8 such ulps; bf16:
  bit-exact; fp16: 99.997% bit-exact, one ulp), from the norm's float32 reduction order.

The interpreter casts float32 to bfloat16 by truncation and to float8 with a faulty carry (triton
3.8 `interpreter._convert_float`); GPUs round to nearest even, as torch does. Under the
interpreter these two casts are replaced by torch's for this module, so the tests hold the kernels
to the GPU's rounding.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.triton_interpreter import check_interpreted, interpreter_as_gpu  # noqa: E402, F401

check_interpreted()
pytestmark = pytest.mark.usefixtures("interpreter_as_gpu")

from pagoda.kernels.activation import silu_and_mul  # noqa: E402
from pagoda.kernels.kv_cache import write_kv_cache  # noqa: E402
from pagoda.kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from pagoda.kernels.paged_cache import KVCache  # noqa: E402
from pagoda.kernels.rotary import rotary_qk  # noqa: E402
from pagoda.kernels.rotary_kv_cache import rotary_write_kv_cache  # noqa: E402
from pagoda.layers.activation import SiluAndMul  # noqa: E402
from pagoda.layers.attention import write_kv_cache as write_kv_cache_torch  # noqa: E402
from pagoda.layers.kv_cache import quantize_kv  # noqa: E402
from pagoda.layers.norm import RMSNorm  # noqa: E402
from pagoda.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8 = torch.float8_e4m3fn
QWEN3_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """Float bits as integers in the order of the values, so a difference counts ulps."""
    int_dtype = {2: torch.int16, 4: torch.int32}[x.element_size()]
    bits = x.contiguous().view(int_dtype).to(torch.int64)
    sign_bit = 1 << (8 * x.element_size() - 1)
    return torch.where(bits < 0, -(bits + sign_bit), bits)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in ulps of a's dtype; +0 and -0 are zero apart."""
    assert a.dtype == b.dtype
    return (_ordered(a) - _ordered(b)).abs()


def _strided(num_tokens: int, width: int, dtype: torch.dtype, pad: int = 0) -> torch.Tensor:
    """(num_tokens, width) random view into rows of width + 2 * pad (row stride > width)."""
    base = torch.randn(num_tokens, width + 2 * pad, device=DEVICE).to(dtype)
    return base[:, pad : pad + width]


# ---- write_kv_cache --------------------------------------------------------------------------
def _junk_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    quant: torch.dtype | None,
) -> KVCache:
    """A cache whose every slot holds junk, so an unwritten slot is told from a written one."""
    cache = KVCache.allocate(num_blocks, block_size, num_kv_heads, head_dim, dtype, quant, DEVICE)
    for t in cache.tensors():
        junk = torch.randn(t.shape, device=DEVICE) * 3 + 4
        if t.dtype == torch.int8:
            junk = junk.mul(20).round().clamp(-127, 127)
        t.copy_(junk.to(t.dtype))
    return cache


def _clone(cache: KVCache) -> KVCache:
    scales = [None if s is None else s.clone() for s in (cache.k_scale, cache.v_scale)]
    return KVCache(cache.k.clone(), cache.v.clone(), *scales)


def _check_int8_codes(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> None:
    """got == want, except codes one apart where x / scale is within 1e-6 of a .5 tie."""
    _, scale = quantize_kv(x, torch.int8)
    y = x.float() / scale.unsqueeze(-1)
    diff = (got.to(torch.int32) - want.to(torch.int32)).abs()
    near_tie = ((y - y.floor()) - 0.5).abs() < 1e-6
    assert int(diff.max()) <= 1
    assert bool(near_tie[diff == 1].all())


@pytest.mark.parametrize("quant", [None, torch.int8, FP8], ids=["float", "int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("num_tokens", "num_kv_heads", "head_dim", "block_size"),
    [(1, 2, 64, 16), (7, 3, 96, 4), (33, 1, 128, 8), (33, 4, 32, 16)],
)
def test_write_kv_cache(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    quant: torch.dtype | None,
) -> None:
    torch.manual_seed(0)
    num_heads = 2 * num_kv_heads
    qkv = _strided(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype, pad=8)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    k[0, 0] = 0.0  # all-zero row: scale = tiny
    k[-1, -1, 3] = 300.0  # an outlier sets its row's scale
    num_blocks = 2 * -(-num_tokens // block_size) + 1
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[1::5] = -1  # padding rows
    cache = _junk_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, quant)
    want = _clone(cache)

    write_kv_cache(k, v, cache, slots)

    real = slots >= 0
    write_kv_cache_torch(k[real], v[real], want, slots[real])
    if quant is None:
        assert torch.equal(cache.k, want.k) and torch.equal(cache.v, want.v)
        return
    assert cache.k_scale is not None and cache.v_scale is not None
    assert want.k_scale is not None and want.v_scale is not None
    assert int(_ulps(cache.k_scale, want.k_scale).max()) <= 1
    assert int(_ulps(cache.v_scale, want.v_scale).max()) <= 1
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[real]] = True
    for got, ref, x in ((cache.k, want.k, k), (cache.v, want.v, v)):
        got_b = got.view(torch.uint8).view(-1, num_kv_heads, head_dim)
        ref_b = ref.view(torch.uint8).view(-1, num_kv_heads, head_dim)
        assert torch.equal(got_b[~written], ref_b[~written])
        if quant == torch.int8:
            rows = slots[real]
            _check_int8_codes(got.view(got_b.shape)[rows], ref.view(got_b.shape)[rows], x[real])
        else:
            assert torch.equal(got_b[written], ref_b[written])


def test_write_kv_cache_padding_only_writes_nothing() -> None:
    torch.manual_seed(0)
    k = torch.randn(3, 2, 64, device=DEVICE)
    v = torch.randn(3, 2, 64, device=DEVICE)
    for quant in (None, torch.int8):
        cache = _junk_cache(2, 4, 2, 64, torch.float32, quant)
        want = _clone(cache)
        write_kv_cache(k, v, cache, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
        for got, ref in zip(cache.tensors(), want.tensors()):
            assert torch.equal(got, ref)


# ---- rms_norm ----------------------------------------------------------------------------------
SHAPES = [(1, 64), (7, 576), (33, 96)]  # (num_tokens, hidden): SmolLM2's 576, a non-power of two


def _check_half_close(
    got: torch.Tensor, want: torch.Tensor, max_ulps: int, min_exact: float
) -> None:
    ulps = _ulps(got, want)
    assert int(ulps.max()) <= max_ulps
    assert float((ulps == 0).float().mean()) >= min_exact


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused_add"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_tokens", "hidden"), SHAPES)
def test_rms_norm(
    num_tokens: int, hidden: int, dtype: torch.dtype, strided: bool, fused: bool
) -> None:
    torch.manual_seed(0)
    pad = 5 if strided else 0
    x = _strided(num_tokens, hidden, dtype, pad) * 3
    residual = _strided(num_tokens, hidden, dtype, pad)
    norm = RMSNorm(hidden, eps=1e-5, dtype=dtype).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(hidden))
        if fused:
            out, hidden_out = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
            want, want_hidden = norm(x, residual)
            assert torch.equal(hidden_out, want_hidden)
        else:
            out, want = rms_norm(x, norm.weight, norm.eps), norm(x)
    assert out.shape == want.shape and out.dtype == dtype and out.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    else:
        _check_half_close(out, want, max_ulps=1, min_exact=0.99)


# ---- silu_and_mul ------------------------------------------------------------------------------
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_tokens", "d"), SHAPES)
def test_silu_and_mul(num_tokens: int, d: int, dtype: torch.dtype, strided: bool) -> None:
    torch.manual_seed(0)
    x = _strided(num_tokens, 2 * d, dtype, pad=3 if strided else 0) * 4
    out = silu_and_mul(x)
    assert out.shape == (num_tokens, d) and out.dtype == dtype and out.is_contiguous()
    gate, up = x.float().chunk(2, dim=-1)
    rounded_once = (torch.nn.functional.silu(gate) * up).to(dtype)
    want = SiluAndMul()(x)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    else:
        assert int(_ulps(out, rounded_once).max()) <= 1
        assert int(_ulps(out, want).max()) <= 2


# ---- rotary_qk ---------------------------------------------------------------------------------
@pytest.mark.parametrize("rope", ["default", "llama3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim"),
    [(1, 4, 2, 64), (7, 3, 1, 128), (33, 9, 3, 32)],
)
def test_rotary_qk(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, rope: str
) -> None:
    torch.manual_seed(0)
    if rope == "llama3":
        params, max_position = LLAMA3_ROPE, 32768
    else:
        params, max_position = {"rope_type": "default", "rope_theta": 10000.0}, 4096
    rotary = RotaryEmbedding(head_dim, max_position, compute_inv_freq(params, head_dim)).to(DEVICE)
    positions = torch.randint(0, max_position, (num_tokens,), device=DEVICE)
    positions[0] = max_position - 1
    cos, sin = rotary.cos_sin(positions, dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    pad = 4
    qkv = torch.randn(num_tokens, pad + q_size + 2 * kv_size + pad, device=DEVICE).to(dtype)
    before = qkv.clone()
    q = qkv[:, pad : pad + q_size]
    k = qkv[:, pad + q_size : pad + q_size + kv_size]
    want_q, want_k = apply_rotary(q, cos, sin, head_dim), apply_rotary(k, cos, sin, head_dim)

    got_q, got_k = rotary_qk(q, k, cos, sin, head_dim)

    assert got_q is q and got_k is k
    untouched = torch.ones(qkv.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[pad : pad + q_size + kv_size] = False  # v and the row padding
    assert torch.equal(qkv[:, untouched], before[:, untouched])
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


# ---- rotary_write_kv_cache ---------------------------------------------------------------------
@pytest.mark.parametrize("quant", [None, torch.int8, FP8], ids=["float", "int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(1, 4, 2, 64, 16), (7, 3, 1, 128, 4), (33, 9, 3, 96, 8), (17, 8, 8, 32, 16)],
)
def test_rotary_write_kv_cache(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    quant: torch.dtype | None,
) -> None:
    """The fused launch equals rotary_qk then write_kv_cache, and leaves k, v and the row padding
    of qkv as they were; padding slots write nothing."""
    torch.manual_seed(0)
    rotary = RotaryEmbedding(head_dim, 32768, compute_inv_freq(LLAMA3_ROPE, head_dim)).to(DEVICE)
    positions = torch.randint(0, 32768, (num_tokens,), device=DEVICE)
    cos, sin = rotary.cos_sin(positions, dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _strided(num_tokens, q_size + 2 * kv_size, dtype, pad=8)
    qkv[0, q_size : q_size + head_dim] = 0.0  # an all-zero key row: scale = tiny
    qkv[-1, -1] = 300.0  # an outlier value sets its row's scale
    before = qkv.clone()
    q, k, v = (
        x.view(num_tokens, -1, head_dim) for x in qkv.split([q_size, kv_size, kv_size], dim=-1)
    )
    num_blocks = 2 * -(-num_tokens // block_size) + 1
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[1::5] = -1  # padding rows
    cache = _junk_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, quant)
    junk = _clone(cache)
    want = _clone(cache)
    want_qkv = qkv.clone()
    want_q, want_k, want_v = (
        x.view(num_tokens, -1, head_dim) for x in want_qkv.split([q_size, kv_size, kv_size], dim=-1)
    )
    rotary_qk(want_q.flatten(1), want_k.flatten(1), cos, sin, head_dim)
    write_kv_cache(want_k, want_v, want, slots)

    rotary_write_kv_cache(q, k, v, cos, sin, cache, slots)

    assert torch.equal(q, want_q)
    assert torch.equal(qkv[:, q_size:], before[:, q_size:])  # k and v not written
    for got, ref in zip(cache.tensors(), want.tensors()):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    if quant is None:  # and against the torch references
        ref_cache = junk
        real = slots >= 0
        k_rot = apply_rotary(before[:, q_size : q_size + kv_size], cos, sin, head_dim)
        k_rot = k_rot.view(num_tokens, num_kv_heads, head_dim)
        write_kv_cache_torch(k_rot[real], v[real], ref_cache, slots[real])
        assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)
        assert torch.equal(q.flatten(1), apply_rotary(before[:, :q_size], cos, sin, head_dim))


def test_rotary_write_kv_cache_no_tokens() -> None:
    cache = _junk_cache(2, 4, 2, 64, torch.float32, None)
    want = _clone(cache)
    empty = torch.empty(0, 2, 64, device=DEVICE)
    trig = torch.empty(0, 1, 32, device=DEVICE)
    slots = torch.empty(0, dtype=torch.int64, device=DEVICE)
    rotary_write_kv_cache(empty, empty, empty, trig, trig, cache, slots)
    assert torch.equal(cache.k, want.k) and torch.equal(cache.v, want.v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim"), [(1, 4, 2, 64), (33, 16, 8, 128)]
)
def test_rotary_write_kv_cache_with_qk_norm(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Qwen3's per-head q/k RMSNorm fused in equals rms_norm per head, then rotary_qk, then
    write_kv_cache, within the norm's tolerance (float32 reduction order)."""
    torch.manual_seed(0)
    block_size, eps = 16, 1e-6
    rotary = RotaryEmbedding(head_dim, 4096, compute_inv_freq(QWEN3_ROPE, head_dim)).to(DEVICE)
    cos, sin = rotary.cos_sin(torch.randint(0, 4096, (num_tokens,), device=DEVICE), dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _strided(num_tokens, q_size + 2 * kv_size, dtype, pad=8)
    w_q, w_k = (torch.rand(head_dim, device=DEVICE).add(0.5).to(dtype) for _ in range(2))
    q, k, v = (
        x.view(num_tokens, -1, head_dim) for x in qkv.split([q_size, kv_size, kv_size], dim=-1)
    )
    slots = torch.randperm(4 * block_size, device=DEVICE)[:num_tokens]
    cache = _junk_cache(4, block_size, num_kv_heads, head_dim, dtype, None)
    want = _clone(cache)
    want_q = rms_norm(q.reshape(-1, head_dim), w_q, eps).view(num_tokens, -1)
    want_k = rms_norm(k.reshape(-1, head_dim), w_k, eps).view(num_tokens, -1)
    rotary_qk(want_q, want_k, cos, sin, head_dim)
    write_kv_cache(want_k.view(k.shape), v, want, slots)

    rotary_write_kv_cache(q, k, v, cos, sin, cache, slots, (w_q, w_k, eps))

    assert torch.equal(cache.v, want.v)
    eps_dtype = torch.finfo(dtype).eps
    for got, ref in ((q, want_q), (cache.k, want.k)):
        got, ref = got.reshape(-1, head_dim).float(), ref.reshape(-1, head_dim).float()
        # An rstd an ulp apart moves each rounding step (norm, weight, the rotation's two
        # products and their sum) by up to an ulp of the head's largest element.
        tol = 4 * eps_dtype * ref.abs().amax(dim=-1, keepdim=True)
        assert bool(((got - ref).abs() <= tol).all())
        if dtype != torch.float32:  # measured: bf16 all bit-exact, fp16 >= 99.99%
            assert float((got == ref).float().mean()) >= 0.99
