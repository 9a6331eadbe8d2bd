"""Triton w4a16 / w8a16 GEMMs and their dequantize kernel (pagoda/kernels/quant_matmul.py) against
dequantize-then-matmul references from pagoda/layers/quant_forms.py, under the Triton
interpreter when there is no GPU; then the CUDA stored forms of layers/quant_forms.py, run here
on CPU by letting `triton_weights` answer yes.

The reference multiplies x (exact in float32) by the float32 weight of `int4_dequantize` (or
code * scale) built from the same stored scales and zero points the kernel reads. The kernel
rounds each dequantized weight to x's dtype before its dot and the output once, so:
- float32: max |y - ref| <= 2e-5 * max |ref| (summation order; measured at most 8.7e-7)
- bfloat16: <= 1.5e-2 * max |ref| (measured at most 4.2e-3); float16: <= 3e-3 (measured 4.9e-4)
- the dequantize kernel: float32 within 1e-6 relative, 16-bit within one ulp of the rounded
  reference (measured: bit-exact in all three; a GPU may fuse the multiply-add)
Measured under the interpreter, torch 2.13 CPU, over the kernel cases here and seeds 0, 1, 2.

Shapes: random ones that leave tails (N not a multiple of the 64-row tile, K not of the 128-column
tile, M not of 16), group sizes 32, 64, 128 and the odd ones (96: tiles inside one group; 256:
larger than a tile; K: one group per row); the real (K, N) of SmolLM2-135M and Qwen3-0.6B layers
at M = 1 in float32 and M = 5 in bfloat16 for some; M = 80 takes the dequantize-then-GEMM path.

As in test_triton_attention.py, Triton 3.8's interpreter multiplies raw bfloat16 bit patterns in
tl.dot and casts float32 -> bfloat16 by truncation; for this module both compute as on a GPU
(operands widened exactly, casts rounded to nearest even). The kernels are unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from tests.triton_interpreter import check_interpreted, interpreter_as_gpu  # noqa: E402, F401

check_interpreted()
pytestmark = pytest.mark.usefixtures("interpreter_as_gpu")

from pagoda.kernels import quant_matmul  # noqa: E402
from pagoda.kernels.quant_matmul import (  # noqa: E402
    GEMM_MAX_M,
    pack_int4,
    unpack_int4,
    w4a16_dequantize,
    w4a16_matmul,
    w8a16_dequantize,
    w8a16_matmul,
)
from pagoda.layers import quant, quant_forms  # noqa: E402
from pagoda.layers.embedding import LMHead, VocabEmbedding  # noqa: E402
from pagoda.layers.linear import Linear, MergedLinear  # noqa: E402
from pagoda.layers.quant import Int4Method, Int8Method  # noqa: E402
from pagoda.layers.quant_forms import (  # noqa: E402
    int4_dequantize,
    quantize_int4_groups,
    quantize_int8_groups,
    quantize_int8_rows,
    set_int4,
    stored_bytes,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2, torch.float16: 3e-3}  # of max |ref|
DTYPES = list(TOL)
# (K, N) of real layers: SmolLM2-135M q/o, k/v, up, down, gate_up; Qwen3-0.6B q, up, down.
SMOLLM2 = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 3072)]
QWEN3 = [(1024, 2048), (1024, 3072), (3072, 1024)]


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return (y.float() - ref).abs().max().item() / ref.abs().max().item()


def _check(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> None:
    assert y.shape == ref.shape and y.dtype == x.dtype and y.device == x.device
    err = _rel_err(y, ref)
    assert err <= TOL[x.dtype], f"max |y - ref| = {err:.3g} of max |ref| > {TOL[x.dtype]}"


def _x(m: int, k: int, dtype: torch.dtype, pad: int = 0) -> torch.Tensor:
    """(m, k) activations, a column view of rows k + pad wide when pad > 0."""
    return torch.randn(m, k + pad, device=DEVICE).to(dtype)[:, :k]


def _int4(n: int, k: int, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(codes (N, K) uint8, scale, zero (N, K // g) in dtype) from a random weight."""
    w = torch.randn(n, k, device=DEVICE) * 0.05
    codes, scale, zero = quantize_int4_groups(w, group)
    return codes, scale.to(dtype), zero.to(dtype)


def _int8(n: int, k: int, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (N, K) int8, scale (N, K // g) in dtype); group == K: one scale per row."""
    w = torch.randn(n, k, device=DEVICE) * 0.05
    if group == k:
        codes, scale = quantize_int8_rows(w)
        return codes, scale[:, None].to(dtype)
    codes, scale = quantize_int8_groups(w, group)
    return codes, scale.to(dtype)


def _int8_dequantize(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return codes.float() * scale.float().repeat_interleave(group, dim=1)


def _run_w4(m: int, n: int, k: int, group: int, dtype: torch.dtype, pad: int = 0) -> None:
    codes, scale, zero = _int4(n, k, group, dtype)
    x = _x(m, k, dtype, pad)
    y = w4a16_matmul(x, pack_int4(codes), scale, zero, group)
    _check(y, x.float() @ int4_dequantize(codes, scale, zero, group).t(), x)


def _run_w8(m: int, n: int, k: int, group: int, dtype: torch.dtype, pad: int = 0) -> None:
    codes, scale = _int8(n, k, group, dtype)
    x = _x(m, k, dtype, pad)
    y = w8a16_matmul(x, codes, scale, group)
    _check(y, x.float() @ _int8_dequantize(codes, scale, group).t(), x)


# ---- layout ---------------------------------------------------------------------------------
def test_pack_int4_puts_the_even_column_in_the_low_nibble() -> None:
    codes = torch.tensor([[1, 2, 15, 0], [7, 8, 3, 12]], dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 2)
    assert packed.tolist() == [[0x21, 0x0F], [0x87, 0xC3]]
    assert torch.equal(unpack_int4(packed), codes)
    every = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(every)), every)


def test_k_tiles_for_group_sizes() -> None:
    # (BLOCK_K, GROUP_K): whole groups per tile, tiles inside one group, one group per row.
    assert quant_matmul._k_tiles(32, 576) == (128, 32)
    assert quant_matmul._k_tiles(128, 1024) == (128, 128)
    assert quant_matmul._k_tiles(256, 1024) == (128, 128)
    assert quant_matmul._k_tiles(96, 384) == (32, 32)
    assert quant_matmul._k_tiles(200, 200) == (128, 128)


# ---- fused GEMM, random shapes --------------------------------------------------------------
# (M, N, K, group): tails in every dimension; groups 32 / 64 / 128, 96 and 256 (see top).
RANDOM = [(1, 48, 256, 32), (5, 100, 384, 64), (16, 80, 640, 128), (3, 72, 384, 96)]
RANDOM += [(7, 40, 512, 256)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n", "k", "group"), RANDOM)
def test_w4a16_random_shapes(m: int, n: int, k: int, group: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    _run_w4(m, n, k, group, dtype, pad=8 if m == 5 else 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n", "k", "group"), [*RANDOM, (5, 70, 200, 200), (2, 33, 96, 96)])
def test_w8a16_random_shapes(m: int, n: int, k: int, group: int, dtype: torch.dtype) -> None:
    """The last two cases are per row (group == K), K = 200 not a multiple of 16."""
    torch.manual_seed(0)
    _run_w8(m, n, k, group, dtype, pad=8 if m == 5 else 0)


def test_leading_dims_and_empty_batches() -> None:
    torch.manual_seed(0)
    codes, scale, zero = _int4(64, 256, 32, torch.float32)
    packed = pack_int4(codes)
    x = torch.randn(2, 3, 256, device=DEVICE)
    y = w4a16_matmul(x, packed, scale, zero, 32)
    ref = x.reshape(6, 256) @ int4_dequantize(codes, scale, zero, 32).t()
    assert y.shape == (2, 3, 64)
    assert _rel_err(y.reshape(6, 64), ref) <= TOL[torch.float32]
    empty = w4a16_matmul(torch.empty(0, 256, device=DEVICE), packed, scale, zero, 32)
    assert empty.shape == (0, 64)


# ---- fused GEMM, real layer shapes ----------------------------------------------------------
@pytest.mark.parametrize(
    ("k", "n", "group"), [(k, n, 32) for k, n in SMOLLM2] + [(576, 192, 64), (1536, 576, 64)]
)
def test_smollm2_shapes_float32(k: int, n: int, group: int) -> None:
    torch.manual_seed(0)
    _run_w4(1, n, k, group, torch.float32)
    _run_w8(1, n, k, group, torch.float32)


@pytest.mark.parametrize(("k", "n"), QWEN3)
def test_qwen3_shapes_float32(k: int, n: int) -> None:
    torch.manual_seed(0)
    _run_w4(1, n, k, 128, torch.float32)
    _run_w8(1, n, k, 32, torch.float32)


@pytest.mark.parametrize(("k", "n", "group"), [(576, 3072, 32), (1536, 576, 64), (3072, 1024, 128)])
def test_real_shapes_bf16(k: int, n: int, group: int) -> None:
    torch.manual_seed(0)
    _run_w4(5, n, k, group, torch.bfloat16)
    _run_w8(16, n, k, group, torch.bfloat16)


def test_lm_head_rows_bf16() -> None:
    """Per-row int8 at a 576-wide head, M = 5 (the vocabulary cut to 1,000 rows here)."""
    torch.manual_seed(0)
    _run_w8(5, 1000, 576, 576, torch.bfloat16)


# ---- dequantize-then-GEMM -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_m_dequantizes_then_multiplies(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    m = GEMM_MAX_M + 16
    _run_w4(m, 100, 384, 32, dtype)
    _run_w4(m, 64, 512, 128, dtype)
    _run_w8(m, 100, 384, 64, dtype)
    _run_w8(m, 70, 200, 200, dtype)  # per row


def test_large_m_in_row_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    monkeypatch.setattr(quant_matmul, "DEQUANT_CHUNK", 40 * 256)  # 40 rows of 256
    _run_w4(GEMM_MAX_M + 1, 100, 256, 32, torch.float32)
    _run_w8(GEMM_MAX_M + 1, 100, 256, 256, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_kernels(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    codes, scale, zero = _int4(100, 384, 32, dtype)
    w = w4a16_dequantize(pack_int4(codes), scale, zero, 32, dtype)
    ref = int4_dequantize(codes, scale, zero, 32)
    c8, s8 = _int8(70, 200, 200, dtype)
    w8 = w8a16_dequantize(c8, s8, 200, dtype)
    ref8 = _int8_dequantize(c8, s8, 200)
    for got, want in ((w, ref), (w8, ref8)):
        assert got.dtype == dtype and got.shape == want.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        else:  # within one ulp of the rounded reference
            torch.testing.assert_close(got, want.to(dtype), rtol=2**-7, atol=0)


# ---- the CUDA stored forms of layers/quant_forms.py, on CPU ---------------------------------
@pytest.fixture
def triton_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers built on this device take the CUDA stored forms and the Triton kernels."""
    monkeypatch.setattr(quant_forms, "triton_weights", lambda device: True)


def _linear(cls: type, *args: Any, dtype: torch.dtype = torch.bfloat16) -> Any:
    torch.manual_seed(0)
    layer = cls(*args, dtype=dtype).to(DEVICE)
    layer.weight.data.normal_(0, 0.05)
    return layer


@pytest.mark.usefixtures("triton_forms")
def test_int4_layer_keeps_packed_codes() -> None:
    layer = _linear(MergedLinear, 256, {"gate": 96, "up": 96})
    w = layer.weight.data.float().clone()
    layer.set_quant_method(Int4Method())
    layer.finalize()
    assert layer.kernel == "w4a16" and layer.group_size == 32 and not hasattr(layer, "weight")
    assert layer.qweight.shape == (192, 128) and layer.qweight.dtype == torch.uint8
    assert layer.scale.shape == layer.zero.shape == (192, 8)
    assert layer.scale.dtype == layer.zero.dtype == torch.bfloat16
    assert stored_bytes(layer) == 192 * 128 + 2 * 192 * 8 * 2  # 5 bits a weight at group 32
    codes, scale, zero = quantize_int4_groups(w, 32)
    assert torch.equal(unpack_int4(layer.qweight), codes)
    x = _x(3, 256, torch.bfloat16)
    ref = x.float() @ int4_dequantize(codes, layer.scale, layer.zero, 32).t()
    _check(layer(x), ref, x)
    assert _rel_err(layer(x), x.float() @ w.t()) < 0.1  # and near the float weight


@pytest.mark.usefixtures("triton_forms")
def test_int8_layer_keeps_codes_and_group_scales() -> None:
    layer = _linear(Linear, 256, 96)
    w = layer.weight.data.float().clone()
    layer.set_quant_method(Int8Method())
    layer.finalize()
    assert layer.kernel == "w8a16" and layer.group_size == 32
    assert layer.qweight.dtype == torch.int8 and layer.qweight.shape == (96, 256)
    assert layer.scale.shape == (96, 8) and layer.scale.dtype == torch.bfloat16
    assert stored_bytes(layer) == 96 * 256 + 96 * 8 * 2
    codes, _ = quantize_int8_groups(w, 32)
    assert torch.equal(layer.qweight, codes)
    x = _x(16, 256, torch.bfloat16)
    _check(layer(x), x.float() @ _int8_dequantize(layer.qweight, layer.scale, 32).t(), x)
    assert _rel_err(layer(x), x.float() @ w.t()) < 0.02  # and near the float weight


@pytest.mark.usefixtures("triton_forms")
def test_int8_rows_where_groups_do_not_fit() -> None:
    layer = _linear(Linear, 256, 36, dtype=torch.float32)  # 2 * 36 rows: not in 16s
    layer.set_quant_method(Int8Method())
    layer.finalize()
    assert layer.kernel == "int8" and layer.weight_scale.dtype == torch.float32
    x = _x(5, 256, torch.float32)
    ref = x @ (layer.qweight.float() * layer.weight_scale[:, None]).t()
    _check(layer(x), ref, x)


@pytest.mark.usefixtures("triton_forms")
def test_act_order_permutes_x() -> None:
    """GPTQ act-order: codes stored with permuted columns, x permuted the same way."""
    torch.manual_seed(0)
    layer = _linear(Linear, 128, 32, dtype=torch.float32)
    layer.device, layer.dtype = layer.weight.device, layer.weight.dtype
    del layer.weight
    layer.quant_method = quant.GPTQMethod(32)
    codes, scale, zero = _int4(32, 128, 32, torch.float32)
    perm = torch.randperm(128, device=DEVICE)
    set_int4(layer, codes, scale, zero, 32, perm)
    assert layer.kernel == "w4a16" and torch.equal(layer.perm, perm)
    x = _x(3, 128, torch.float32)
    ref = x[:, perm] @ int4_dequantize(codes, scale, zero, 32).t()
    _check(layer(x), ref, x)


@pytest.mark.usefixtures("triton_forms")
def test_tied_int8_embedding_and_head() -> None:
    torch.manual_seed(0)
    emb = VocabEmbedding(300, 64, dtype=torch.bfloat16).to(DEVICE)
    emb.weight.data.normal_(0, 0.05)
    head = LMHead(300, 64, dtype=torch.bfloat16).to(DEVICE)
    head.tie_to(emb)
    emb.quantize_int8()
    head.quantize_int8()
    assert emb.kernel == "int8" and emb.weight_scale.dtype == torch.bfloat16
    w = emb.qweight.float() * emb.weight_scale.float()[:, None]
    ids = torch.tensor([0, 7, 299, 7], device=DEVICE)
    assert torch.equal(emb(ids), w[ids].to(torch.bfloat16))
    h = _x(4, 64, torch.bfloat16)
    logits = head(h)
    assert logits.dtype == torch.float32
    _check(logits.to(torch.bfloat16), h.float() @ w.t(), h)
