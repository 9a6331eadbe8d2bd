"""Quantized matmuls against their dequantize-then-matmul references; GGUF block decoding
against the gguf package, bit for bit; the layer and embedding plumbing of layers/quant.py
and layers/quant_forms.py.

Tolerances: the packed CPU ops take bf16 activations and bf16 scales and return bf16, so a
quantized matmul is compared with the float32 matmul of its dequantized weight on the same
bf16-rounded input; the rest is bf16 rounding of scales and output, bounded here by 1% of the
largest |output| (measured: at most 0.8%).

These are torch's forms, so pagoda's CPU kernels are off here (PAGODA_CPU_KERNELS=0); layers
on the kernels' forms are tested in test_cpu_kernels.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize, quantize

from pagoda.config import EngineConfig
from pagoda.layers import gguf as gguf_blocks
from pagoda.layers.embedding import LMHead, VocabEmbedding
from pagoda.layers.linear import Linear, MergedLinear
from pagoda.layers.quant import (
    FP8Method,
    GGUFMethod,
    Int4Method,
    Int8Method,
    make_method,
    unpack_int32,
)
from pagoda.layers.quant_forms import (
    int4_dequantize,
    int4_matmul,
    int4_pack,
    int8_matmul,
    quantize_int4_groups,
    quantize_int8_groups,
    quantize_int8_rows,
    split_int8_groups,
    stored_bytes,
)


@pytest.fixture(autouse=True)
def _torch_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "0")


REAL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2 qkv, o, gate_up, down


def _close(y: torch.Tensor, ref: torch.Tensor, rel: float = 1e-2) -> None:
    err = (y.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= rel * scale, f"max error {err:.4g} > {rel} * {scale:.4g}"


def _bf16_round(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


# ---- GGUF blocks ---------------------------------------------------------------------------


def _random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks whose f16 fields (d, dmin) are finite and of a realistic size."""
    per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    n = rows * cols // per_block
    raw = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        values = rng.uniform(-0.05, 0.05, size=n).astype(np.float16)
        raw[:, at : at + 2] = values.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, cols // per_block * nbytes)


# Byte offsets of each block's f16 fields (ggml-common.h's block structs).
_F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K"])
@pytest.mark.parametrize("rows,cols", [(16, 256), (48, 512)])
def test_gguf_block_decoding_is_bit_exact(qtype: str, rows: int, cols: int) -> None:
    raw = _random_blocks(qtype, rows, cols, np.random.default_rng(rows + cols))
    w = gguf_blocks.GGUFWeight(qtype, raw, (rows, cols))
    ours = gguf_blocks.dequantize_groups(gguf_blocks.decode(w))
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float32))
    assert torch.equal(ours, ref.reshape(rows, cols))
    assert torch.equal(w.dequantize(), ours)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_gguf_decoding_of_quantized_floats(qtype: str) -> None:
    data = np.random.default_rng(0).standard_normal((32, 128)).astype(np.float32)
    raw = quantize(data, GGMLQuantizationType[qtype])
    g = gguf_blocks.decode(gguf_blocks.GGUFWeight(qtype, raw, (32, 128)))
    ref = dequantize(raw, GGMLQuantizationType[qtype])
    assert np.array_equal(gguf_blocks.dequantize_groups(g).numpy(), ref)
    if qtype in gguf_blocks.FOUR_BIT_TYPES:
        assert int(g.codes.max()) <= 15 and g.codes.dtype == torch.uint8
    else:
        assert g.codes.dtype == torch.int8 and g.offset is None
    if qtype == "Q5_0":  # all 32 codes in use: the fifth bit is read
        assert int(g.codes.min()) == -16 and int(g.codes.max()) == 15


def test_gguf_decoding_of_the_embedded_model() -> None:
    from gguf import GGUFReader

    from pagoda.loading.model_files import resolve_model

    folder, name = resolve_model(None)
    reader = GGUFReader(f"{folder}/{name}")
    seen = set()
    for t in reader.tensors:
        if t.tensor_type.name in ("Q4_1", "Q8_0") and t.tensor_type.name not in seen:
            seen.add(t.tensor_type.name)
            rows = int(np.prod(t.shape[1:]))
            w = gguf_blocks.GGUFWeight(t.tensor_type.name, t.data, (rows, int(t.shape[0])))
            ref = dequantize(t.data, t.tensor_type).reshape(rows, -1)
            assert np.array_equal(gguf_blocks.dequantize_groups(gguf_blocks.decode(w)).numpy(), ref)
    assert seen == {"Q4_1", "Q8_0"}


def test_gguf_row_permutation_moves_whole_rows() -> None:
    raw = _random_blocks("Q4_1", 32, 64, np.random.default_rng(1))
    w = gguf_blocks.GGUFWeight("Q4_1", raw, (32, 64))
    order = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(w.permute_rows(order).dequantize(), w.dequantize()[order])


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K"])
def test_gguf_tensor_parallel_shards_are_exact_slices(qtype: str) -> None:
    """A rank's shard, cut from the raw blocks (rows, or whole blocks of columns), dequantizes
    to exactly its slice of the whole tensor; a cut inside a block is a ValueError."""
    raw = _random_blocks(qtype, 32, 512, np.random.default_rng(2))
    w = gguf_blocks.GGUFWeight(qtype, raw, (32, 512))
    full = w.dequantize()
    assert torch.equal(w.narrow(0, 16, 16).dequantize(), full[16:32])
    assert torch.equal(w.narrow(1, 256, 256).dequantize(), full[:, 256:])
    with pytest.raises(ValueError, match="splits only on its"):
        w.narrow(1, 0, 16 if qtype != "Q4_K" else 128)


# ---- kernels -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n,k,group",
    [
        (n, k, group)
        for n, k in [(16, 64), (48, 128), *REAL_SHAPES]
        for group in (32, 64)
        if k % group == 0
    ],
)
@pytest.mark.parametrize("m", [1, 5, 64])
def test_int4_matmul_matches_dequantized_reference(n: int, k: int, m: int, group: int) -> None:
    g = torch.Generator().manual_seed(n * k + m)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    zero = torch.randn(n, k // group, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    packed, scale_zeros = int4_pack(codes, scale, zero)
    y = int4_matmul(x, packed, scale_zeros, group)
    assert y.shape == (m, n) and y.dtype == torch.float32
    ref_w = int4_dequantize(codes, _bf16_round(scale), _bf16_round(zero), group)
    _close(y, _bf16_round(x) @ ref_w.t())


@pytest.mark.parametrize("n,k", [(16, 64), *REAL_SHAPES, (4096, 576)])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_int8_matmul_matches_dequantized_reference(n: int, k: int, m: int) -> None:
    g = torch.Generator().manual_seed(n + k + m)
    w = torch.randn(n, k, generator=g) * 0.05
    codes, scale = quantize_int8_rows(w)
    x = torch.randn(m, k, generator=g)
    y = int8_matmul(x, codes, scale.to(torch.bfloat16))
    ref_w = codes.float() * _bf16_round(scale)[:, None]
    _close(y, _bf16_round(x) @ ref_w.t())


def test_int8_rows_round_trip_within_half_a_step() -> None:
    w = torch.randn(64, 96) * torch.logspace(-3, 0, 64)[:, None]
    codes, scale = quantize_int8_rows(w)
    err = (codes.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()
    assert codes.abs().max() == 127


@pytest.mark.parametrize("group", [32, 128])
def test_int4_groups_round_trip_within_half_a_step(group: int) -> None:
    w = torch.randn(32, 256) * 0.1
    w[0] = w[0].abs() + 1.0  # an all-positive row: the float zero point need not hold 0
    codes, scale, zero = quantize_int4_groups(w, group)
    back = int4_dequantize(codes, scale, zero, group)
    step = scale.repeat_interleave(group, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert int(codes.max()) <= 15


# ---- layers --------------------------------------------------------------------------------


def _linear_with(method: object, n: int, k: int, bias: bool = True) -> tuple[Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(n * 7 + k)
    layer = Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(n, generator=g))
    w = layer.weight.detach().clone()
    layer.set_quant_method(method)  # type: ignore[arg-type]
    layer.finalize()
    return layer, w


@pytest.mark.parametrize(
    "method,rel_weight_err",
    [(Int8Method(), 0.01), (Int4Method(), 0.15), (FP8Method(), 0.07)],
    ids=["int8", "int4", "fp8"],
)
def test_quantized_linear_close_to_float(method: object, rel_weight_err: float) -> None:
    layer, w = _linear_with(method, 192, 576)
    x = torch.randn(9, 576)
    y = layer(x)
    ref = x @ w.t() + layer.bias
    err = (y - ref).norm() / (ref - layer.bias).norm()
    assert err < rel_weight_err, f"relative error {err:.4f}"
    assert not hasattr(layer, "weight") or not isinstance(layer.weight, torch.nn.Parameter)


def test_int4_linear_is_its_kernel_on_its_own_codes() -> None:
    layer, w = _linear_with(Int4Method(), 64, 256, bias=False)
    assert layer.group_size == 32
    codes, scale, zero = quantize_int4_groups(w, 32)
    x = torch.randn(3, 256)
    ref = _bf16_round(x) @ int4_dequantize(codes, _bf16_round(scale), _bf16_round(zero), 32).t()
    _close(layer(x), ref)


def test_int4_falls_back_to_int8_when_rows_do_not_fit_the_kernel() -> None:
    layer, _ = _linear_with(Int4Method(), 40, 64)  # 40 rows: not a multiple of 16
    assert layer.kernel == "int8"


def test_gguf_merged_layer_matches_gguf_dequantization() -> None:
    rng = np.random.default_rng(3)
    sizes = {"q": 64, "k": 32, "v": 32}
    layer = MergedLinear(128, sizes)
    layer.set_quant_method(GGUFMethod())
    parts = {}
    for shard, rows in sizes.items():
        data = rng.standard_normal((rows, 128)).astype(np.float32)
        raw = quantize(data, GGMLQuantizationType.Q4_1)
        parts[shard] = gguf_blocks.GGUFWeight("Q4_1", raw, (rows, 128))
    for shard in ("v", "q", "k"):  # any arrival order
        layer.load("weight", parts[shard], shard)
    layer.finalize()
    assert layer.kernel == "int4" and layer.group_size == 32
    ref_w = torch.cat([parts[s].dequantize() for s in sizes])
    x = torch.randn(4, 128)
    _close(layer(x), _bf16_round(x) @ ref_w.t(), rel=1.5e-2)


def _gguf_linear(qtype: str, data: np.ndarray) -> Linear:
    rows, cols = data.shape
    layer = Linear(cols, rows)
    layer.set_quant_method(GGUFMethod())
    raw = quantize(data, GGMLQuantizationType[qtype])
    layer.load("weight", gguf_blocks.GGUFWeight(qtype, raw, (rows, cols)))
    layer.finalize()
    return layer


def test_gguf_q8_0_layer_runs_its_exact_codes_as_two_int4_halves() -> None:
    data = np.random.default_rng(4).standard_normal((48, 256)).astype(np.float32)
    layer = _gguf_linear("Q8_0", data)
    assert layer.kernel == "int8x2" and layer.group_size == 32
    ref_w = torch.from_numpy(
        dequantize(quantize(data, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    )
    x = torch.randn(5, 256)
    _close(layer(x), _bf16_round(x) @ ref_w.t())


@pytest.mark.parametrize("qtype", ["Q5_0", "IQ4_NL"])
def test_gguf_q5_0_and_iq4_nl_layers_keep_their_codes_as_int8_groups(qtype: str) -> None:
    raw = _random_blocks(qtype, 48, 256, np.random.default_rng(4))
    w = gguf_blocks.GGUFWeight(qtype, raw, (48, 256))
    layer = Linear(256, 48)
    layer.set_quant_method(GGUFMethod())
    layer.load("weight", w)
    layer.finalize()
    assert layer.kernel == "int8x2"
    x = torch.randn(5, 256)
    _close(layer(x), _bf16_round(x) @ w.dequantize().t())


def test_gguf_layer_mixing_q8_0_and_q5_0_keeps_both_codes() -> None:
    layer = MergedLinear(256, {"gate": 32, "up": 48})
    layer.set_quant_method(GGUFMethod())
    rng = np.random.default_rng(6)
    refs = []
    for shard, qtype, rows in (("gate", "Q8_0", 32), ("up", "Q5_0", 48)):
        raw = quantize(
            rng.standard_normal((rows, 256)).astype(np.float32), GGMLQuantizationType[qtype]
        )
        layer.load("weight", gguf_blocks.GGUFWeight(qtype, raw, (rows, 256)), shard)
        refs.append(torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype])))
    layer.finalize()
    assert layer.kernel == "int8x2"
    x = torch.randn(3, 256)
    _close(layer(x), _bf16_round(x) @ torch.cat(refs).t())


@pytest.mark.parametrize("qtype", ["Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_gguf_layer_of_other_types_uses_int8_rows(qtype: str) -> None:
    """No group decoding: the gguf package's dequantization, re-quantized per row to int8."""
    raw = _random_blocks(qtype, 32, 256, np.random.default_rng(5))
    w = gguf_blocks.GGUFWeight(qtype, raw, (32, 256))
    layer = Linear(256, 32)
    layer.set_quant_method(GGUFMethod())
    layer.load("weight", w)
    layer.finalize()
    assert layer.kernel == "int8"
    x = torch.randn(2, 256)
    # int8 rows: each weight within scale / 2 = amax / 254 of the reference.
    _close(layer(x), x @ w.dequantize().t(), rel=2e-2)


def test_gguf_float_layer_stays_float() -> None:
    data = np.random.default_rng(5).standard_normal((32, 64)).astype(np.float32)
    x = torch.randn(2, 64)
    f32 = Linear(64, 32)
    f32.set_quant_method(GGUFMethod())
    f32.load("weight", torch.from_numpy(data))
    f32.finalize()
    assert f32.kernel == "float" and torch.equal(f32(x), x @ torch.from_numpy(data).t())


@pytest.mark.parametrize("n,k", [(16, 64), *REAL_SHAPES])
def test_int8_groups_split_into_int4_halves_is_exact(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    codes, scale = quantize_int8_groups(w, 32)
    half_codes, half_scale, half_zero = split_int8_groups(codes, scale)
    assert int(half_codes.max()) <= 15 and half_codes.shape == (2 * n, k)
    halves = int4_dequantize(half_codes, half_scale, half_zero, 32)
    expected = codes.float() * scale.repeat_interleave(32, dim=1)
    assert torch.allclose(halves[:n] + halves[n:], expected, rtol=0, atol=1e-6)
    assert ((expected - w).abs() <= scale.repeat_interleave(32, dim=1) / 2 + 1e-7).all()


def test_gguf_layer_missing_a_shard_is_a_value_error() -> None:
    layer = MergedLinear(64, {"gate": 32, "up": 32})
    layer.set_quant_method(GGUFMethod())
    layer.load("weight", torch.zeros(32, 64), "gate")
    with pytest.raises(ValueError, match="up"):
        layer.finalize()


def test_tied_int8_embedding_and_head_share_one_matrix() -> None:
    g = torch.Generator().manual_seed(0)
    emb = VocabEmbedding(1000, 64)
    head = LMHead(1000, 64)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(1000, 64, generator=g))
    head.tie_to(emb)
    w = emb.weight.detach().clone()
    emb.quantize_int8()
    head.quantize_int8()
    ids = torch.tensor([0, 5, 999, 5])
    codes, scale = quantize_int8_rows(w)
    expected_rows = codes.float()[ids] * _bf16_round(scale)[ids, None]
    assert torch.allclose(emb(ids), expected_rows)
    x = torch.randn(3, 64)
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (3, 1000)
    _close(logits, _bf16_round(x) @ (codes.float() * _bf16_round(scale)[:, None]).t())
    assert stored_bytes(emb) < w.numel() * 4 / 3.5
    assert sum(1 for _ in head.parameters()) == 0 and sum(1 for _ in head.buffers()) == 0


def test_unpack_int32_orders() -> None:
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_int32(word, 1, (0, 1, 2, 3, 4, 5, 6, 7)).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    # AWQ: nibble i holds column (0, 2, 4, 6, 1, 3, 5, 7)[i]
    assert unpack_int32(word, 1, (0, 2, 4, 6, 1, 3, 5, 7)).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert unpack_int32(word, 0, (0, 1, 2, 3, 4, 5, 6, 7)).flatten().tolist() == list(range(8))


def test_method_names_and_config_validation() -> None:
    assert make_method("none") is None
    for name in ("int8", "int4", "fp8", "gguf", "awq", "gptq"):
        method = make_method(name, {"group_size": 128, "bits": 4})
        assert method is not None and method.name == name
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="bits"):
        make_method("gptq", {"group_size": 128, "bits": 8})
