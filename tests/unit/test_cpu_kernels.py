"""pagoda's CPU kernels (pagoda/kernels/cpu): each quantized matmul against its torch reference
over the GGUF formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_XS, each in the form the GGUF method leaves) and int8 rows, odd shapes, every instruction set
this CPU has (scalar, AVX2, AVX-512 VNNI) and 1 or 2 threads; the paged decode attention against
paged_attention_torch's decode path. Skipped where the extension cannot be built (no compiler):
pagoda then runs on torch's ops.

Two references for the matmuls: the exact one (the activations quantized as the kernel does,
then a float64 matmul against the weights the kernel holds: its fp16 scales and offsets) within
float32 rounding, and the plain one (float activations, the file's weights) within the bound
the int8 activations allow: half a quantization step of each group times the group's |w| sum.
Every GGUF form holds the file's weights exactly (the super-block types their own 6-bit and int8
scales, the others their fp16 ones)."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagoda.kernels.cpu import built
from pagoda.kernels.paged_cache import KVCache
from pagoda.layers import gguf
from pagoda.layers.activation import GeluTanhAndMul, SiluAndMul
from pagoda.layers.attention import paged_attention_torch
from pagoda.layers.cpu_forms import (
    FLOAT16_KERNELS,
    NIBBLE_FORMS,
    KernelPart,
    cpu_q8_rows,
    pack_q4x16,
    pack_q5x16,
    pack_q8x16,
)
from pagoda.layers.embedding import LMHead, VocabEmbedding
from pagoda.layers.forward_context import AttentionMetadata
from pagoda.layers.linear import MergedLinear
from pagoda.layers.norm import RMSNorm
from pagoda.layers.quant import GGUFMethod, gguf_cpu_form
from pagoda.layers.quant_forms import quantize_int8_rows

OPS = built()
pytestmark = pytest.mark.skipif(OPS is None, reason="the CPU kernels cannot be built here")
ISAS = [] if OPS is None else list(range(OPS.isa() + 1))
# The quantized matmuls' isa_limits: 3 adds the tile unit (AMX) where OPS.amx(), for passes of
# 16 rows and more; where the CPU has no AMX it runs the VNNI path, so it is only listed there.
MATMUL_ISAS = ISAS + ([3] if ISAS and ISAS[-1] == 2 else [])


# Where a block's fp16 fields start and how many there are: (d, m) / (d, dmin), or d alone.
_FP16_FIELDS = {
    **dict.fromkeys(("Q4_1", "Q5_1", "Q4_K", "Q5_K"), (0, 2)),
    "Q2_K": (80, 2),
    "Q3_K": (108, 1),
    "Q6_K": (208, 1),
}


def _blocks(qtype: str, rows: int, cols: int, seed: int) -> gguf.GGUFWeight:
    """Random GGUF blocks with finite fp16 scales (F16 / BF16: random normal weights / 20)."""
    per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    if qtype in gguf.FLOAT16_TYPES:
        w = torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32)) / 20
        bits = w.to(torch.float16 if qtype == "F16" else torch.bfloat16).view(torch.uint8)
        return gguf.GGUFWeight(qtype, bits.numpy(), (rows, cols))
    n = rows * cols // per_block
    raw = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    at, fields = _FP16_FIELDS.get(qtype, (0, 1))
    scales = rng.uniform(0.001, 0.02, size=(n, fields)).astype(np.float16)
    raw[:, at : at + 2 * fields] = scales.view(np.uint8).reshape(n, 2 * fields)
    return gguf.GGUFWeight(qtype, raw.reshape(rows, -1), (rows, cols))


def _activations(x: torch.Tensor) -> torch.Tensor:
    assert OPS is not None
    q, xd, _ = OPS.quantize_activations(x)
    m, k = x.shape
    return (q.double().view(m, k // 32, 32) * xd.double()[..., None]).view(m, k)


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|x_q @ w^T - x @ w^T| <= sum_g (amax_g / 127 / 2) * sum_{k in g} |w[n, k]|."""
    m, k = x.shape
    half_step = x.abs().view(m, k // 32, 32).amax(-1).double() / 127 / 2  # (M, G)
    wsum = w.abs().double().view(w.shape[0], k // 32, 32).sum(-1)  # (N, G)
    return half_step @ wsum.T


# The form each GGUF type keeps on the CPU kernels.
KERNEL_OF = {
    "Q4_0": "cpu_q4_0",
    "Q4_1": "cpu_q4",
    "Q5_0": "cpu_q5",
    "Q5_1": "cpu_q5_1",
    "Q8_0": "cpu_q8",
    "IQ4_NL": "cpu_iq4nl",
    "Q4_K": "cpu_q4k",
    "Q5_K": "cpu_q5k",
    "Q6_K": "cpu_q6k",
    "IQ4_XS": "cpu_iq4xs",
    "Q3_K": "cpu_q3k",
    "Q2_K": "cpu_q2k",
    "F16": "cpu_f16",
    "BF16": "cpu_bf16",
}
QTYPES = list(KERNEL_OF)


def _held(weight: gguf.GGUFWeight) -> KernelPart:
    """The weight in the form the GGUF method leaves on the CPU kernels."""
    held = KernelPart(SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32))
    assert gguf_cpu_form(held, [weight])
    assert held.kernel == KERNEL_OF[weight.qtype] and held.cpu_rows == weight.shape[0]
    return held


def _matmul(held: KernelPart, x: torch.Tensor, isa: int) -> torch.Tensor:
    assert OPS is not None
    if held.kernel == "cpu_q8":
        return OPS.q8x16_matmul(x, held.packed, held.packed_scales, held.cpu_rows, isa)
    if held.kernel in FLOAT16_KERNELS:
        return OPS.f16x16_matmul(x, held.packed, held.cpu_rows, isa, held.kernel == "cpu_bf16")
    return OPS.q4x16_matmul(x, held.packed, held.cpu_rows, isa, NIBBLE_FORMS[held.kernel])


def _run(qtype: str, x: torch.Tensor, weight: gguf.GGUFWeight, isa: int) -> torch.Tensor:
    return _matmul(_held(weight), x, isa)


def _check(qtype: str, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y against the exact product of what the kernels multiply: the int8 activations (F16 /
    BF16: the float32 ones) and the file's weights w (float64), within float32 rounding (F16 /
    BF16: the float32 dot product's bound, K * 2^-24 * |x| @ |w|^T)."""
    if qtype in gguf.FLOAT16_TYPES:
        exact = x.double() @ w.T
        bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ w.abs().T)
        assert ((y.double() - exact).abs() <= bound + 1e-30).all()
        return
    exact = _activations(x) @ w.T
    scale = exact.abs().amax().item()
    torch.testing.assert_close(y.double(), exact, rtol=0, atol=2e-6 * scale + 1e-6)


@pytest.mark.parametrize("isa", MATMUL_ISAS)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 37, 256), (3, 64, 512), (5, 1538, 256), (9, 20, 768), (67, 48, 256)]
)
def test_gguf_formats_match_the_reference(
    threads: int, isa: int, qtype: str, m: int, n: int, k: int
) -> None:
    weight = _blocks(qtype, n, k, seed=m * 1000 + n)
    w = weight.dequantize().double()  # the gguf package's own decoding: what the kernels hold
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    y = _run(qtype, x, weight, isa)
    assert y.shape == (m, n) and y.dtype == torch.float32
    _check(qtype, y, x, w)
    plain = (x.double() @ w.T - y.double()).abs()
    assert (plain <= _bound(x, w) * 1.001 + 1e-5).all()


# Bytes a row takes per block of the file: the file's, but where the kernels hold 6-bit
# sub-scales a byte each (Q4_K / Q5_K: 8 scales and 8 mins in 12 bytes -> 16; IQ4_XS: 8 in 6 -> 8;
# Q3_K: 16 in 12 -> 16).
FORM_BYTES = {"Q4_K": 148, "Q5_K": 180, "IQ4_XS": 138, "Q3_K": 114}


@pytest.mark.parametrize("qtype", [q for q in QTYPES if q != "Q8_0"])
def test_the_nibble_and_float16_forms_hold_the_file_s_bytes_and_numbers(qtype: str) -> None:
    """16 rows of a tile take 16 x the file's bytes per block (FORM_BYTES where they differ);
    rows past the tensor's (padding) are zeros. The numbers are the file's: unit activations
    give gguf's dequantization."""
    rows, cols = 37, 512
    weight = _blocks(qtype, rows, cols, seed=7)
    if qtype in gguf.K_TYPES:
        assert torch.equal(gguf.dequantize_k(gguf.decode_k(weight)), weight.dequantize())
    held = _held(weight)
    per_block, file_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    assert weight.data.shape == (rows, file_bytes * cols // per_block)
    per_row = FORM_BYTES.get(qtype, file_bytes) * cols // per_block
    assert held.packed.numel() * held.packed.element_size() == 48 * per_row
    y = _matmul(held, torch.eye(cols), ISAS[-1]).T  # unit rows: w itself
    w = weight.dequantize()
    torch.testing.assert_close(y[:rows], w, rtol=1e-6, atol=1e-6 * w.abs().max().item())
    assert y[rows:].eq(0).all()


def test_q4x16_tiles_lay_out_sixteen_rows_per_group_for_dot_products() -> None:
    n, k = 20, 64  # two tiles, the second padded with 12 zero rows
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.arange(1, n * 2 + 1, dtype=torch.float32).view(n, 2) / 64
    offset = -scale * 8
    packed = pack_q4x16(codes, scale, offset)
    assert packed.shape == (2, 2, 320) and packed.dtype == torch.uint8
    for row in range(n):
        tile, j = divmod(row, 16)
        for g in range(2):
            group = packed[tile, g]
            for c in range(32):  # block c // 8; low nibble for c % 8 < 4
                s, e = divmod(c, 8)
                byte = int(group[64 * s + 4 * j + e % 4])
                assert (byte >> 4 if e >= 4 else byte & 15) == codes[row, 32 * g + c]
            halves = group[256:].view(torch.float16).float()
            assert halves[j] == scale[row, g] and halves[16 + j] == offset[row, g]
    assert packed[1, :, :256].view(2, 4, 16, 4)[:, :, 4:].eq(0).all()  # padding rows: codes 0
    with pytest.raises(ValueError, match="fp16"):
        pack_q4x16(codes, scale * 1e6, offset)


def test_q5x16_tiles_hold_q4_nibbles_a_plane_of_fifth_bits_and_fp16_scales() -> None:
    n, k = 20, 64  # two tiles, the second padded with 12 zero rows
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.arange(1, n * 2 + 1, dtype=torch.float32).view(n, 2) / 64
    packed = pack_q5x16(codes, scale)
    assert packed.shape == (2, 2, 352) and packed.dtype == torch.uint8
    for row in range(n):
        tile, j = divmod(row, 16)
        for g in range(2):
            group = packed[tile, g]
            masks = [
                int.from_bytes(bytes(group[256 + 8 * i : 264 + 8 * i].tolist()), "little")
                for i in range(8)
            ]
            for c in range(32):  # block c // 8; low nibble (mask 2s) for c % 8 < 4
                s, e = divmod(c, 8)
                byte = int(group[64 * s + 4 * j + e % 4])
                low = byte >> 4 if e >= 4 else byte & 15
                fifth = (masks[2 * s + (e >= 4)] >> (4 * j + e % 4)) & 1
                assert low | fifth << 4 == codes[row, 32 * g + c]
            assert group[320:].view(torch.float16).float()[j] == scale[row, g]
    assert packed[1, :, :320].view(2, 5, 16, 4)[:, :4, 4:].eq(0).all()  # padding: codes 0


def test_q8x16_tiles_hold_codes_plus_128_and_float_scales() -> None:
    n, k = 18, 64
    codes, scale = quantize_int8_rows(torch.randn(n, k, generator=torch.Generator().manual_seed(1)))
    packed, scales = pack_q8x16(codes, scale[:, None])
    assert packed.shape == (2, 2, 512) and scales.shape == (2, 1, 16)
    for row in range(n):
        tile, j = divmod(row, 16)
        for c in range(k):
            g, s, e = c // 32, (c % 32) // 4, c % 4
            assert int(packed[tile, g, 64 * s + 4 * j + e]) - 128 == codes[row, c]
        assert scales[tile, 0, j] == scale[row]
    assert packed[1].view(2, 8, 16, 4)[:, :, 2:].eq(128).all() and scales[1, 0, 2:].eq(0).all()
    ids = torch.tensor([17, 0, 5, 17])
    assert torch.equal(cpu_q8_rows(_Held(packed, scales), ids), codes[ids] * scale[ids, None])


class _Held:
    def __init__(self, packed: torch.Tensor, scales: torch.Tensor) -> None:
        self.packed, self.packed_scales = packed, scales


def test_tiles_of_the_wrong_shape_are_refused() -> None:
    assert OPS is not None
    packed = pack_q4x16(
        torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(16, 2)
    )
    with pytest.raises(RuntimeError, match="packed shape"):
        OPS.q4x16_matmul(torch.randn(1, 64), packed, 20, 2, 0)  # 20 rows need 2 tiles
    with pytest.raises(RuntimeError, match="packed shape"):
        OPS.q4x16_matmul(torch.randn(1, 96), packed, 16, 2, 0)  # K of 96: 3 groups
    with pytest.raises(RuntimeError, match="packed shape"):
        OPS.q4x16_matmul(torch.randn(1, 64), packed, 16, 2, NIBBLE_FORMS["cpu_q5"])  # 320 bytes
    with pytest.raises(RuntimeError, match="form: 0 .. 10"):
        OPS.q4x16_matmul(torch.randn(1, 64), packed, 16, 2, 11)
    codes, scales = pack_q8x16(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 1))
    with pytest.raises(RuntimeError, match="scales"):
        OPS.q8x16_matmul(torch.randn(1, 64), codes, torch.ones(1, 3, 16), 16, 2)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        OPS.q8x16_matmul(torch.randn(1, 40), codes, scales, 16, 2)


@pytest.mark.parametrize(("capability", "cap"), [("avx2", 1), ("default", 0), ("avx512", 2)])
def test_aten_cpu_capability_caps_the_kernels_isa_for_the_process(
    capability: str, cap: int
) -> None:
    """ATEN_CPU_CAPABILITY, torch's switch, caps the instruction set the kernels pick (an
    AVX-512 machine then runs the AVX2 path end to end); the extension is the one built."""
    assert OPS is not None
    code = "from pagoda.kernels.cpu import built; print(built().isa())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert int(out.stdout.strip().splitlines()[-1]) == min(cap, OPS.isa())


@pytest.mark.parametrize("isa", MATMUL_ISAS)
def test_a_row_gets_the_same_bits_in_any_batch(isa: int) -> None:
    """Every pass size (1 .. 8 rows on AVX-512 VNNI; on AVX2 1 .. 4, and 1 .. 8 for the forms
    whose tiles take a block at a time: Q4_0, Q4_1, Q4_K, Q6_K; AVX2 passes of 1-2 rows walk a
    tile once for both its 8-row halves, larger ones twice; isa 3 with AMX, 16 rows on the tile
    unit and the rest on VNNI) does each row's arithmetic alone: a verification step's rows equal
    the plain steps' exactly."""
    assert OPS is not None
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (40, 96), dtype=torch.uint8, generator=gen)
    q4 = pack_q4x16(
        codes, torch.rand(40, 3, generator=gen) * 0.02, torch.randn(40, 3, generator=gen)
    )
    q8_codes, q8_scale = quantize_int8_rows(torch.randn(40, 96, generator=gen))
    q8, q8_scales = pack_q8x16(q8_codes, q8_scale[:, None])
    q5_codes = torch.randint(0, 32, (40, 96), dtype=torch.uint8, generator=gen)
    q5 = pack_q5x16(q5_codes, (torch.rand(40, 3, generator=gen) * 0.02).half().float())
    x = torch.randn(19, 96, generator=gen)
    alone4 = torch.cat([OPS.q4x16_matmul(x[i : i + 1], q4, 40, isa, 0) for i in range(19)])
    alone5 = torch.cat([OPS.q4x16_matmul(x[i : i + 1], q5, 40, isa, 1) for i in range(19)])
    alone8 = torch.cat([OPS.q8x16_matmul(x[i : i + 1], q8, q8_scales, 40, isa) for i in range(19)])
    super_blocks = {q: _held(_blocks(q, 40, 256, seed=5)) for q in ("Q4_K", "Q6_K")}
    xk = torch.randn(19, 256, generator=gen)
    alone_k = {
        q: torch.cat([_matmul(held, xk[i : i + 1], isa) for i in range(19)])
        for q, held in super_blocks.items()
    }
    for m in range(2, 20):
        assert torch.equal(OPS.q4x16_matmul(x[:m], q4, 40, isa, 0), alone4[:m]), m
        assert torch.equal(OPS.q4x16_matmul(x[:m], q5, 40, isa, 1), alone5[:m]), m
        assert torch.equal(OPS.q8x16_matmul(x[:m], q8, q8_scales, 40, isa), alone8[:m]), m
        for q, held in super_blocks.items():
            assert torch.equal(_matmul(held, xk[:m], isa), alone_k[q][:m]), (q, m)


@pytest.mark.parametrize("isa", MATMUL_ISAS)
def test_a_prefill_sized_call_gives_each_row_its_bits_alone(threads: int, isa: int) -> None:
    """A call of 512 groups of 32 or more (common.h QUANTIZE_GRAIN: a prefill chunk's) quantizes
    its activations, and Q6_K's sums per 16 values, over torch's threads: each of its 70 rows of
    256 values (560 groups) equals the same row's call alone, whatever the thread count."""
    assert OPS is not None
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(70, 256, generator=gen)
    codes = torch.randint(0, 16, (40, 256), dtype=torch.uint8, generator=gen)
    q4 = pack_q4x16(
        codes, torch.rand(40, 8, generator=gen) * 0.02, torch.randn(40, 8, generator=gen)
    )
    q8_codes, q8_scale = quantize_int8_rows(torch.randn(40, 256, generator=gen))
    q8, q8_scales = pack_q8x16(q8_codes, q8_scale[:, None])
    calls = {
        "q4": lambda rows: OPS.q4x16_matmul(rows, q4, 40, isa, 0),
        "q8": lambda rows: OPS.q8x16_matmul(rows, q8, q8_scales, 40, isa),
        **{q: partial(_matmul, _held(_blocks(q, 40, 256, 7)), isa=isa) for q in ("Q4_K", "Q6_K")},
    }
    for name, call in calls.items():
        alone = torch.cat([call(x[i : i + 1]) for i in range(70)])
        assert torch.equal(call(x), alone), name


@pytest.mark.parametrize("qtype", [q for q in QTYPES if q not in gguf.FLOAT16_TYPES])
@pytest.mark.parametrize("m", [16, 17, 33, 70])
def test_the_tile_unit_gives_the_vnni_bits(threads: int, qtype: str, m: int) -> None:
    """isa_limit 3 (AMX where OPS.amx(): passes of 16 rows on the tile unit, the rest of the rows
    on VNNI) gives every quantized form the VNNI path's bits, on a tile count that splits
    unevenly over the threads and a partial last tile; the int8 rows (one scale a row, an LM
    head's) too."""
    assert OPS is not None
    if OPS.isa() < 2:
        assert not OPS.amx()  # no VNNI path to match: the tile path is never taken
        return
    gen = torch.Generator().manual_seed(m)
    held = _held(_blocks(qtype, 53, 512, seed=m))
    x = torch.randn(m, 512, generator=gen)
    assert torch.equal(_matmul(held, x, 3), _matmul(held, x, 2))
    codes, scale = quantize_int8_rows(torch.randn(53, 512, generator=gen))
    rows = pack_q8x16(codes, scale[:, None])
    assert torch.equal(OPS.q8x16_matmul(x, *rows, 53, 3), OPS.q8x16_matmul(x, *rows, 53, 2))


def test_amx_is_used_only_where_the_cpu_lists_it_and_can_be_turned_off() -> None:
    """OPS.amx() never claims the tile unit on a CPU whose flags lack AMX-INT8 (it also runs a
    tile instruction before it says yes), and PAGODA_CPU_AMX=0 turns it off for the process."""
    assert OPS is not None
    flags = Path("/proc/cpuinfo").read_text().split()
    if OPS.amx():
        assert "amx_int8" in flags and "amx_tile" in flags
    code = "from pagoda.kernels.cpu import built; print(built().amx())"
    env = {**os.environ, "PAGODA_CPU_AMX": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("isa", MATMUL_ISAS)
@pytest.mark.parametrize("m", [1, 2, 6, 33])
def test_int8_rows_match_the_reference(threads: int, isa: int, m: int) -> None:
    assert OPS is not None
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(203, 576, generator=gen)  # an LM head's shape: rows not in 16s
    w[7] = 0  # a zero row: scale 1e-12 / 127
    codes, scale = quantize_int8_rows(w)
    x = torch.randn(m, 576, generator=gen)
    y = OPS.q8x16_matmul(x, *pack_q8x16(codes, scale[:, None]), 203, isa)
    wq = codes.double() * scale.double()[:, None]
    exact = _activations(x) @ wq.T
    torch.testing.assert_close(y.double(), exact, rtol=0, atol=2e-6 * exact.abs().amax().item())


# ---- layers holding the kernels' forms (layers/quant.py, quant_forms.py, embedding.py) -------


@pytest.fixture
def kernels_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "1")


def _gguf_layer(sizes: dict[str, int], qtype: str, cols: int) -> tuple[MergedLinear, torch.Tensor]:
    """A packed GGUF layer loaded shard by shard, and the file's weights."""
    layer = MergedLinear(cols, sizes)
    layer.set_quant_method(GGUFMethod())
    parts = {s: _blocks(qtype, rows, cols, seed=rows) for s, rows in sizes.items()}
    for shard in reversed(sizes):  # any arrival order
        layer.load("weight", parts[shard], shard)
    layer.finalize()
    return layer, torch.cat([parts[s].dequantize().double() for s in sizes])


@pytest.mark.usefixtures("kernels_on")
@pytest.mark.parametrize(("qtype", "kernel"), list(KERNEL_OF.items()))
def test_a_gguf_layer_keeps_only_the_kernel_form_for_any_row_count(qtype: str, kernel: str) -> None:
    # 88 rows: not in 16s (torch's int4 op would not take them: int8 rows, re-quantized)
    layer, held = _gguf_layer({"q": 40, "k": 24, "v": 24}, qtype, 256)
    assert layer.kernel == kernel and layer.cpu_rows == 88
    assert {n for n, _ in layer.named_buffers()} <= {"packed", "packed_scales"}
    for m in (1, 7):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
        _check(qtype, layer(x), x, held)


@pytest.mark.usefixtures("kernels_on")
@pytest.mark.parametrize(
    ("types", "kernels"),
    [
        (("Q4_K", "Q4_K", "Q6_K"), ["cpu_q4k", "cpu_q4k", "cpu_q6k"]),  # Q4_K_M's qkv
        (("Q5_0", "Q5_0", "Q8_0"), ["cpu_q5", "cpu_q5", "cpu_q8"]),  # the 0.5B and Gemma's
    ],
)
def test_a_merged_layer_of_mixed_types_keeps_each_shard_s_own_form(
    types: tuple[str, ...], kernels: list[str]
) -> None:
    """Each shard keeps its type's form (nothing re-quantized to int8 rows), the outputs
    concatenated in shard order; the norm before it runs as its own op, the same bits as
    the unfused norm then the layer."""
    sizes = {"q": 40, "k": 24, "v": 24}
    layer = MergedLinear(256, sizes)
    layer.set_quant_method(GGUFMethod())
    parts = {s: _blocks(t, sizes[s], 256, seed=i) for i, (s, t) in enumerate(zip(sizes, types))}
    for shard in reversed(sizes):
        layer.load("weight", parts[shard], shard)
    layer.finalize()
    assert layer.kernel == "cpu_parts" and layer.cpu_rows == 88
    assert [p.kernel for p in layer.parts] == kernels
    held = torch.cat([parts[s].dequantize().double() for s in sizes])
    gen = torch.Generator().manual_seed(4)
    x, residual = torch.randn(5, 256, generator=gen), torch.randn(5, 256, generator=gen)
    exact = _activations(x) @ held.T
    torch.testing.assert_close(layer(x).double(), exact, rtol=0, atol=2e-6 * exact.abs().max())
    norm = RMSNorm(256)
    norm.cpu_kernel = True
    y, hidden = layer.after_norm(x, residual, norm)
    normed, plain_hidden = norm(x, residual)
    assert torch.equal(y, layer(normed)) and torch.equal(hidden, plain_hidden)


@pytest.mark.usefixtures("kernels_on")
def test_a_gguf_gate_up_runs_its_silu_in_its_own_call() -> None:
    """Linear.gated_after_norm: a gate | up layer in a nibble form gives (silu_and_mul of its
    product after the norm, the residual sum) in one op, the bits of after_norm then the
    activation, at a decode's rows and a prefill's; None where the activation is not SiLU (the
    decoder layer then takes the separate calls)."""
    layer, _ = _gguf_layer({"gate": 48, "up": 48}, "Q4_K", 256)
    norm, act = RMSNorm(256), SiluAndMul()
    norm.cpu_kernel = act.cpu_kernel = True
    for t in (1, 40):
        gen = torch.Generator().manual_seed(t)
        x, residual = torch.randn(t, 256, generator=gen), torch.randn(t, 256, generator=gen)
        gated = layer.gated_after_norm(x, residual, norm, act)
        assert gated is not None
        gate_up, hidden = layer.after_norm(x, residual, norm)
        assert torch.equal(gated[0], act(gate_up)) and torch.equal(gated[1], hidden)
    gelu = GeluTanhAndMul()
    gelu.cpu_kernel = True
    assert layer.gated_after_norm(x, residual, norm, gelu) is None


@pytest.mark.usefixtures("kernels_on")
def test_an_untied_gguf_head_keeps_the_file_s_form_a_tied_matrix_int8_rows() -> None:
    """The head's own tensor (`lm_head.weight`, GGUF `output.weight`) keeps its type's form; the
    embedding's matrix, which a later pipeline stage loads for a tied head, stays int8 rows as
    the one-process model's tied head."""
    weight = _blocks("Q6_K", 40, 256, seed=3)
    own, tied = LMHead(40, 256), LMHead(40, 256)
    own.load(weight, "lm_head.weight")
    tied.load(weight, "model.embed_tokens.weight")
    own.quantize_int8()
    tied.quantize_int8()
    assert own.kernel == "cpu_q6k" and tied.kernel == "cpu_q8"
    assert tied.packed_scales.shape == (3, 1, 16)  # one scale a row
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    exact = _activations(x) @ weight.dequantize().double().T
    torch.testing.assert_close(own(x).double(), exact, rtol=0, atol=2e-6 * exact.abs().max())


@pytest.fixture
def half_kernels_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "1")
    monkeypatch.setenv("PAGODA_CPU_HALF_KERNELS", "1")


@pytest.mark.usefixtures("half_kernels_on")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_float_layer_keeps_the_rows_alone_float16_form(dtype: torch.dtype) -> None:
    """-q none in bfloat16 / float16 with PAGODA_CPU_HALF_KERNELS=1: a layer's weight and an
    untied head's take the kernels' float16 form (the same 2 bytes a weight): float32 products
    of the half weights and the activations, rounded to the model's dtype once, each row the
    same bits in any batch."""
    kernel = "cpu_bf16" if dtype == torch.bfloat16 else "cpu_f16"
    g = torch.Generator().manual_seed(0)
    layer, head = MergedLinear(64, {"a": 48, "b": 40}, dtype=dtype), LMHead(100, 64, dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(88, 64, generator=g))
        head.weight.copy_(torch.randn(100, 64, generator=g))
    weights = (layer.weight.detach().clone(), head.weight.detach().clone())
    layer.finalize()
    head.keep_half_on_cpu()
    assert layer.kernel == head.kernel == kernel
    assert not list(layer.parameters()) and not list(head.parameters())
    x = torch.randn(9, 64, generator=g).to(dtype)
    for module, w, out_dtype in ((layer, weights[0], dtype), (head, weights[1], torch.float32)):
        y = module(x)
        assert y.dtype == out_dtype
        # rounded to the dtype once: at most an ulp apart (eps relative), or float32's
        # accumulation error of 64 products where a sum cancels (atol)
        exact = (x.double() @ w.double().T).to(dtype).double()
        torch.testing.assert_close(y.double(), exact, rtol=torch.finfo(dtype).eps, atol=1e-4)
        for m in (1, 2, 5):
            assert torch.equal(module(x[:m]), y[:m])


@pytest.mark.usefixtures("kernels_on")
def test_half_float_layers_stay_torch_s_by_default() -> None:
    layer = MergedLinear(64, {"a": 48}, dtype=torch.bfloat16)
    layer.finalize()
    assert layer.kernel is None and layer.weight.dtype == torch.bfloat16


@pytest.mark.usefixtures("half_kernels_on")
def test_a_float32_or_tied_float_layer_stays_torch_s() -> None:
    layer = MergedLinear(64, {"a": 48})
    layer.finalize()
    assert layer.kernel is None and layer.weight.dtype == torch.float32
    emb, head = VocabEmbedding(100, 64, torch.bfloat16), LMHead(100, 64, torch.bfloat16)
    head.tie_to(emb)
    head.keep_half_on_cpu()
    assert head.kernel == emb.kernel == "float"


@pytest.mark.usefixtures("kernels_on")
def test_the_tied_vocabulary_is_int8_rows_once() -> None:
    emb, head = VocabEmbedding(1000, 64), LMHead(1000, 64)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(1000, 64, generator=torch.Generator().manual_seed(0)))
    head.tie_to(emb)
    codes, scale = quantize_int8_rows(emb.weight.detach())
    emb.quantize_int8()
    head.quantize_int8()
    assert emb.kernel == "cpu_q8" and not list(head.buffers()) and not list(head.parameters())
    ids = torch.tensor([0, 5, 999, 5])
    assert torch.equal(emb(ids), codes[ids].float() * scale[ids, None])
    x = torch.randn(3, 64)
    exact = _activations(x) @ (codes.double() * scale.double()[:, None]).T
    torch.testing.assert_close(head(x).double(), exact, rtol=0, atol=2e-6 * exact.abs().max())


def test_activations_are_quantized_per_group_of_32() -> None:
    assert OPS is not None
    x = torch.randn(3, 96) * torch.tensor([0.01, 1.0, 100.0]).repeat_interleave(32)
    x[1, 32:64] = 0  # an all-zero group: scale 0, codes 0
    q, xd, xs = OPS.quantize_activations(x)
    groups = x.view(3, 3, 32)
    assert torch.equal(xd, groups.abs().amax(-1) / 127)
    expected = torch.round(groups / xd[..., None].clamp(min=1e-30)).to(torch.int8)
    expected[1, 1] = 0
    assert torch.equal(q.view(3, 3, 32), expected)
    torch.testing.assert_close(xs, xd * q.view(3, 3, 32).float().sum(-1))
    assert q.abs().max() == 127


def test_torch_compile_keeps_the_op_in_its_graph() -> None:
    assert OPS is not None
    codes, scale = quantize_int8_rows(torch.randn(16, 64))
    packed, scales = pack_q8x16(codes, scale[:, None])

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pagoda_cpu.q8x16_matmul(x * 2, packed, scales, 16, 2) + 1

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    x = torch.randn(2, 64)
    torch.testing.assert_close(compiled(x), f(x))


# ---- paged decode attention --------------------------------------------------------------------


def _decode_case(
    lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int, seed: int
) -> tuple[torch.Tensor, KVCache, torch.Tensor, torch.Tensor]:
    """Queries, a float32 cache of random rows, each request's blocks scattered over it."""
    gen = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-n // block_size) for n in lens))
    num_blocks = len(lens) * width + 3
    cache = KVCache(
        torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen),
        torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen),
    )
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, dim, generator=gen) * 2  # peaked and flat rows alike
    return q, cache, tables.to(torch.int32).contiguous(), torch.tensor(lens, dtype=torch.int32)


def _reference(
    q: torch.Tensor, cache: KVCache, tables: torch.Tensor, lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """paged_attention_torch's decode rows (SDPA over the gathered keys and values)."""
    b = q.shape[0]
    none = torch.zeros(0, dtype=torch.int32)
    meta = AttentionMetadata(
        num_tokens=b,
        query_lens=[1] * b,
        seq_lens=lens.tolist(),
        slot_mapping=torch.zeros(b, dtype=torch.int64),
        decode_token_idx=torch.arange(b),
        decode_seq_lens=lens,
        decode_block_tables=tables,
        prefill_token_start=none,
        prefill_query_lens=none,
        prefill_seq_lens=none,
        prefill_block_tables=tables[:0],
        prefills=[],
        max_prefill_query_len=0,
        query_start_loc=none,
        req_seq_lens=none,
        req_block_tables=tables[:0],
    )
    return paged_attention_torch(q, cache, meta, scale)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("lens", "heads", "kv_heads", "dim", "block_size"),
    [
        ([1], 9, 3, 64, 16),  # SmolLM2's heads, a first decode step
        ([255], 9, 3, 64, 16),
        ([37, 1, 600, 129], 8, 8, 64, 16),  # no GQA, a request past two chunks
        ([70, 5], 16, 2, 128, 32),  # groups of 8, 128-wide heads
        ([19, 3], 6, 3, 20, 4),  # a head width not a multiple of 8, tiny blocks
    ],
)
def test_paged_decode_attention_matches_the_reference(
    threads: int, isa: int, lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int
) -> None:
    assert OPS is not None
    q, cache, tables, seq_lens = _decode_case(lens, heads, kv_heads, dim, block_size, len(lens))
    scale = dim**-0.5
    out = OPS.paged_decode_attention(q, cache.k, cache.v, tables, seq_lens, scale, 0, isa)
    expected = _reference(q, cache, tables, seq_lens, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    # float32 sums of a few hundred terms, a polynomial exp within 2e-7
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_gives_padding_rows_zeros() -> None:
    assert OPS is not None
    q, cache, tables, seq_lens = _decode_case([0, 40], 4, 2, 32, 16, 0)
    out = OPS.paged_decode_attention(q, cache.k, cache.v, tables, seq_lens, 0.2, 0, 2)
    assert out[0].eq(0).all()
    torch.testing.assert_close(out[1:], _reference(q[1:], cache, tables[1:], seq_lens[1:], 0.2))


def test_paged_decode_attention_reads_a_view_of_a_wider_table() -> None:
    """The runner passes its block-table buffer's first columns: rows with a stride."""
    assert OPS is not None
    q, cache, tables, seq_lens = _decode_case([40, 70], 9, 3, 64, 16, 1)
    wide = torch.full((2, tables.shape[1] + 7), -1, dtype=torch.int32)
    wide[:, : tables.shape[1]] = tables
    view = wide[:, : tables.shape[1]]
    assert not view.is_contiguous()
    out = OPS.paged_decode_attention(q, cache.k, cache.v, view, seq_lens, 0.125, 0, 2)
    expected = OPS.paged_decode_attention(q, cache.k, cache.v, tables, seq_lens, 0.125, 0, 2)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("isa", ISAS)
def test_paged_decode_attention_gives_a_request_the_same_bits_in_any_batch(
    threads: int, isa: int
) -> None:
    """A request's chunks follow its own length, not the batch's longest: speculative
    verification rows (lengths L+1 .. L+5 in one step) equal plain steps at each length. 190
    and 194 split differently from 258 and from each other (48 / 64 positions)."""
    assert OPS is not None
    lens = [190, 194, 258, 33, 1]
    q, cache, tables, seq_lens = _decode_case(lens, 9, 3, 64, 16, 3)
    together = OPS.paged_decode_attention(q, cache.k, cache.v, tables, seq_lens, 0.125, 0, isa)
    for b in range(len(lens)):
        one = slice(b, b + 1)
        alone = OPS.paged_decode_attention(
            q[one], cache.k, cache.v, tables[one], seq_lens[one], 0.125, 0, isa
        )
        assert torch.equal(together[one], alone), b


@pytest.mark.parametrize("isa", ISAS)
def test_paged_decode_attention_reads_a_requests_verification_rows_once(
    threads: int, isa: int
) -> None:
    """A request's verification rows (one table, lengths L+1 .. L+k) share one pass over its
    keys and values, each row still getting its bits from alone: in groups of at most 8 (rows of
    177 .. 184 positions), across a chunk-size change (192 and 193 positions split into 48 and 64),
    and never over a block the group's first row does not hold: row 0 (174
    positions, 11 blocks) has a stale id past its own blocks, as the runner's rows may, which
    the rows from 177 positions on would read if grouped with it."""
    assert OPS is not None
    q, cache, tables, seq_lens = _decode_case([200], 9, 3, 64, 16, 4)
    lens = torch.tensor(list(range(174, 185)) + list(range(190, 197)), dtype=torch.int32)
    rows = lens.shape[0]
    table = tables.repeat(rows, 1)
    table[0, 11:] = (table[0, 11] + 1) % cache.k.shape[0]
    queries = torch.randn(rows, 9, 64, generator=torch.Generator().manual_seed(5))
    together = OPS.paged_decode_attention(queries, cache.k, cache.v, table, lens, 0.125, 0, isa)
    for b in range(rows):
        one = slice(b, b + 1)
        alone = OPS.paged_decode_attention(
            queries[one], cache.k, cache.v, table[one], lens[one], 0.125, 0, isa
        )
        assert torch.equal(together[one], alone), b
    expected = _reference(queries, cache, table, lens, 0.125)
    torch.testing.assert_close(together, expected, rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_refuses_what_it_cannot_take() -> None:
    assert OPS is not None
    q, cache, tables, seq_lens = _decode_case([20], 4, 2, 32, 16, 0)
    with pytest.raises(RuntimeError, match="float32"):
        OPS.paged_decode_attention(
            q, cache.k.double(), cache.v.double(), tables, seq_lens, 0.2, 0, 2
        )
    with pytest.raises(RuntimeError, match="beyond the block table"):
        OPS.paged_decode_attention(q, cache.k, cache.v, tables, seq_lens + 100, 0.2, 0, 2)
    with pytest.raises(RuntimeError, match="outside the cache"):
        OPS.paged_decode_attention(q, cache.k, cache.v, tables + 1000, seq_lens, 0.2, 0, 2)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        OPS.paged_decode_attention(q[:, :3], cache.k, cache.v, tables, seq_lens, 0.2, 0, 2)


# ---- paged attention over prefill chunks and decodes -------------------------------------------


def _rows_case(
    q_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, dim: int, seed: int
) -> tuple[torch.Tensor, KVCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q of every row, cache, block tables, query_start, seq_lens) of a mixed step."""
    _, cache, tables, lens = _decode_case(seq_lens, heads, kv_heads, dim, 16, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen) * 2
    starts = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    return q, cache, tables, starts, lens


# (query rows, length) per request: a whole prompt, a chunk after cached context across the
# chunk-size change (64 -> 80 positions), a decode, a 5-row verification step, a
# prompt past MAX_CHUNK (256) positions
MIXED = ([40, 30, 1, 5, 300], [40, 330, 77, 190, 300])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (12, 2, 128), (6, 3, 20)])
def test_paged_attention_gives_each_row_its_decode_bits(
    threads: int, isa: int, heads: int, kv_heads: int, dim: int
) -> None:
    """Every row of a mixed step equals paged_decode_attention of that row alone at its
    position: a position's attention is the same bits as a whole prompt, a chunk, a decode or
    a verification row, the invariant that keeps the quantized path deterministic."""
    assert OPS is not None
    q_lens, seq_lens = MIXED
    q, cache, tables, starts, lens = _rows_case(q_lens, seq_lens, heads, kv_heads, dim, 7)
    out = OPS.paged_attention(q, cache.k, cache.v, tables, starts, lens, 0.125, 0, isa)
    for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for i in range(q_len):
            t = int(starts[r]) + i
            length = torch.tensor([seq_len - q_len + i + 1], dtype=torch.int32)
            alone = OPS.paged_decode_attention(
                q[t : t + 1], cache.k, cache.v, tables[r : r + 1], length, 0.125, 0, isa
            )
            assert torch.equal(out[t : t + 1], alone), (r, i)


@pytest.mark.parametrize("isa", ISAS)
def test_paged_attention_gives_the_same_bits_at_any_thread_count(isa: int) -> None:
    """A row's chunks follow its length alone: a tensor-parallel worker on its share of the
    cores computes a head as the single process does."""
    assert OPS is not None
    q, cache, tables, starts, lens = _rows_case(*MIXED, 9, 3, 64, 9)
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(
                OPS.paged_attention(q, cache.k, cache.v, tables, starts, lens, 0.125, 0, isa)
            )
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("isa", ISAS)
def test_paged_attention_matches_the_reference(threads: int, isa: int) -> None:
    """Against paged_attention_torch (SDPA with a causal mask per prefill, decode rows apart)."""
    assert OPS is not None
    from pagoda.runner.step_inputs import build_attention_metadata

    q_lens, seq_lens = MIXED
    q, cache, tables, starts, lens = _rows_case(q_lens, seq_lens, 9, 3, 64, 8)
    out = OPS.paged_attention(q, cache.k, cache.v, tables, starts, lens, 0.125, 0, isa)
    meta = build_attention_metadata(q_lens, seq_lens, tables.tolist(), 16)
    expected = paged_attention_torch(q, cache, meta, 0.125)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_refuses_what_it_cannot_take() -> None:
    assert OPS is not None
    q, cache, tables, starts, lens = _rows_case([4, 1], [10, 20], 4, 2, 32, 0)
    with pytest.raises(RuntimeError, match="query_start"):
        OPS.paged_attention(q, cache.k, cache.v, tables, starts[:2], lens, 0.2, 0, 2)
    with pytest.raises(RuntimeError, match="from 0 to the rows of q"):
        OPS.paged_attention(q[:3], cache.k, cache.v, tables, starts, lens, 0.2, 0, 2)
    with pytest.raises(RuntimeError, match="query rows must be 1..seq_len"):
        OPS.paged_attention(q, cache.k, cache.v, tables, starts, lens.clamp(max=3), 0.2, 0, 2)
    with pytest.raises(RuntimeError, match="outside the cache"):
        OPS.paged_attention(q, cache.k, cache.v, tables + 1000, starts, lens, 0.2, 0, 2)


# ---- row ops (row_ops.cpp) and the matmuls' prologues --------------------------------------------


def _rows(t: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(t, n, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [576, 64, 37])  # SmolLM2's width, a head, a ragged tail
def test_rms_norm_matches_torch_and_each_row_keeps_its_bits(isa: int, n: int) -> None:
    assert OPS is not None
    x, residual = _rows(9, n, 1), _rows(9, n, 2)
    weight = _rows(1, n, 3)[0]
    out, hidden = OPS.add_rms_norm(x, residual, weight, 1e-5, isa)
    h = x + residual
    assert torch.equal(hidden, h)
    want = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(out, want, rtol=2e-6, atol=1e-6)  # sums of n squares, rounded
    assert torch.equal(OPS.rms_norm(h, weight, 1e-5, isa), out)
    for t in (0, 4, 8):  # a row alone, out of a view with a row stride
        one, _ = OPS.add_rms_norm(x[t : t + 1], residual[t : t + 1], weight, 1e-5, isa)
        assert torch.equal(one, out[t : t + 1])
    first, same = OPS.add_rms_norm(x, None, weight, 1e-5, isa)  # a model's first layer
    assert torch.equal(same, x) and torch.equal(first, OPS.rms_norm(x, weight, 1e-5, isa))
    wide = torch.cat([x, residual], dim=1)[:, :n]  # rows with a stride
    assert torch.equal(OPS.rms_norm(wide, weight, 1e-5, isa), OPS.rms_norm(x, weight, 1e-5, isa))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d", [1536, 40])
def test_silu_and_mul_matches_torch_and_each_row_keeps_its_bits(isa: int, d: int) -> None:
    assert OPS is not None
    x = _rows(7, 2 * d, 4)
    x[0, :4] = torch.tensor([-60.0, 60.0, 0.0, -0.0])  # exp's floor, a saturated sigmoid, zeros
    out = OPS.silu_and_mul(x, isa)
    gate, up = x.chunk(2, dim=-1)
    # the SIMD paths' exp is a polynomial within about 2e-7
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    for t in range(7):
        assert torch.equal(OPS.silu_and_mul(x[t : t + 1], isa), out[t : t + 1])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_matches_torch_and_each_row_keeps_its_bits(
    isa: int, dtype: torch.dtype
) -> None:
    """Gemma's GeGLU: gate * sigmoid(2z), torch's g / 2 * (1 + tanh(z)) without its cancellation
    for negative z, where torch's float32 1 + tanh(z) is off by up to an ulp of 1: an absolute
    error up to 2^-24 |gate * up| on top of the relative 1e-6 of the exp polynomial (half rows:
    two roundings of the dtype's on top)."""
    assert OPS is not None
    x = _rows(7, 2 * 1040, 12)
    x[0, :6] = torch.tensor([-60.0, 60.0, 0.0, -0.0, 1e-4, -1e-4])
    x = x.to(dtype)
    out = OPS.gelu_tanh_and_mul(x, isa)
    gate, up = x.chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    rtol = 1e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    bound = rtol * want.float().abs() + 2.0**-24 * (gate.float() * up.float()).abs()
    assert out.dtype == dtype and bool(((out.float() - want.float()).abs() <= bound).all())
    for t in range(7):
        assert torch.equal(OPS.gelu_tanh_and_mul(x[t : t + 1], isa), out[t : t + 1])


def test_rotary_matches_apply_rotary_on_a_view_of_qkv() -> None:
    from pagoda.layers.rotary import apply_rotary

    assert OPS is not None
    qkv = _rows(5, 15 * 64 + 3 * 64, 5)
    qk = qkv[:, : 12 * 64]  # q and k heads, rows with qkv's stride
    angles = _rows(5, 32, 6)
    cos, sin = angles.cos(), angles.sin()
    out = OPS.rotary(qk, cos, sin, 64, 2)
    want = apply_rotary(qk, cos[:, None], sin[:, None], 64)
    torch.testing.assert_close(out, want, rtol=0, atol=2e-6)
    for t in range(5):
        assert torch.equal(
            OPS.rotary(qk[t : t + 1], cos[t : t + 1], sin[t : t + 1], 64, 2), out[t : t + 1]
        )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_rows_round_where_torch_s_half_ops_do(isa: int, dtype: torch.dtype) -> None:
    """A half model's rows (layers/norm.py CPU_ROW_DTYPES): each op rounds its result to the
    rows' dtype where torch's eager ops on half tensors do, so it stays within the float32
    rounding of their inputs (the norm's sum order, silu's exp polynomial), which can move a
    rounding by one unit in the last place at each of the norm's two roundings (2 ulps) and
    at silu's (1 ulp, then the product's); rotary's products and sums round as torch's do,
    exactly. Each row keeps its bits alone."""
    from pagoda.layers.rotary import apply_rotary

    assert OPS is not None
    ulps = 2 * torch.finfo(dtype).eps  # eps: one unit in the last place at 1.0
    x, residual = _rows(9, 576, 1).to(dtype), _rows(9, 576, 2).to(dtype)
    weight = _rows(1, 576, 3)[0].to(dtype)
    out, hidden = OPS.add_rms_norm(x, residual, weight, 1e-5, isa)
    assert out.dtype == hidden.dtype == dtype and torch.equal(hidden, x + residual)
    h = (x + residual).float()
    want = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    torch.testing.assert_close(out, want, rtol=ulps, atol=0)
    first, same = OPS.add_rms_norm(x, None, weight, 1e-5, isa)
    assert torch.equal(same, x) and torch.equal(first, OPS.rms_norm(x, weight, 1e-5, isa))
    gate_up = _rows(7, 2 * 1536, 4).to(dtype)
    act = OPS.silu_and_mul(gate_up, isa)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(act, F.silu(gate) * up, rtol=ulps, atol=0)
    qk, angles = _rows(5, 12 * 64, 5).to(dtype), _rows(5, 32, 6)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    rotated = OPS.rotary(qk, cos, sin, 64, isa)
    assert torch.equal(rotated, apply_rotary(qk, cos[:, None], sin[:, None], 64))
    for t in range(5):
        one, _ = OPS.add_rms_norm(x[t : t + 1], residual[t : t + 1], weight, 1e-5, isa)
        assert torch.equal(one, out[t : t + 1])
        assert torch.equal(OPS.silu_and_mul(gate_up[t : t + 1], isa), act[t : t + 1])
        assert torch.equal(
            OPS.rotary(qk[t : t + 1], cos[t : t + 1], sin[t : t + 1], 64, isa), rotated[t : t + 1]
        )
    with pytest.raises(RuntimeError, match="dtype"):
        OPS.add_rms_norm(x, residual.float(), weight, 1e-5, isa)
    with pytest.raises(RuntimeError, match="dtype"):
        OPS.rms_norm(x, weight.float(), 1e-5, isa)


@pytest.mark.parametrize("isa", [*ISAS, 3])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q6_K"])
def test_gate_up_with_its_silu_equals_the_ops_apart(isa: int, qtype: str) -> None:
    """q4x16_matmul_norm_silu: the norm, the gate | up matmul and SiLU-and-mul in one call give
    the ops' bits apart: below GATED_MIN_ROWS (32) rows as the whole product, from it in gate /
    up tile pairs (a row block boundary at 256 rows crossed; isa 3 takes AMX where there is
    one); each row the bits it has alone. A gate | up that is not whole tiles is refused."""
    assert OPS is not None
    k, d = 256, 48
    held = _held(_blocks(qtype, 2 * d, k, 3))
    form = NIBBLE_FORMS[held.kernel]
    weight = _rows(1, k, 10)[0]
    for t in (1, 31, 32, 300):
        x, residual = _rows(t, k, 8), _rows(t, k, 9)
        y, hidden = OPS.q4x16_matmul_norm(x, residual, weight, 1e-5, held.packed, 2 * d, isa, form)
        act, h = OPS.q4x16_matmul_norm_silu(
            x, residual, weight, 1e-5, held.packed, 2 * d, isa, form
        )
        assert torch.equal(h, hidden) and torch.equal(act, OPS.silu_and_mul(y, isa)), t
        if t == 300:
            alone, _ = OPS.q4x16_matmul_norm_silu(
                x[299:], residual[299:], weight, 1e-5, held.packed, 2 * d, isa, form
            )
            assert torch.equal(alone, act[299:])
    with pytest.raises(RuntimeError, match=r"gate \| up"):
        OPS.q4x16_matmul_norm_silu(x, residual, weight, 1e-5, held.packed, 2 * d - 16, isa, form)


@pytest.mark.parametrize("isa", ISAS)
def test_matmul_prologues_equal_the_ops_apart(isa: int) -> None:
    """q4 / q8 matmuls with the norm or the activation in the same call: the bits of the row op,
    then the matmul."""
    assert OPS is not None
    k, n = 128, 48
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(7))
    scale, offset = torch.rand(n, k // 32) * 0.02 + 1e-3, torch.randn(n, k // 32) * 0.05
    q4 = pack_q4x16(codes, scale, offset)
    codes8, scale8 = quantize_int8_rows(torch.randn(n, k))
    q8, q8_scales = pack_q8x16(codes8, scale8[:, None])
    x, residual, weight = _rows(6, k, 8), _rows(6, k, 9), _rows(1, k, 10)[0]
    normed, hidden = OPS.add_rms_norm(x, residual, weight, 1e-5, isa)
    y4, h4 = OPS.q4x16_matmul_norm(x, residual, weight, 1e-5, q4, n, isa, 0)
    y8, h8 = OPS.q8x16_matmul_norm(x, residual, weight, 1e-5, q8, q8_scales, n, isa)
    assert torch.equal(h4, hidden) and torch.equal(h8, hidden)
    assert torch.equal(y4, OPS.q4x16_matmul(normed, q4, n, isa, 0))
    assert torch.equal(y8, OPS.q8x16_matmul(normed, q8, q8_scales, n, isa))
    gate_up = _rows(6, 2 * k, 11)
    act = OPS.silu_and_mul(gate_up, isa)
    assert torch.equal(
        OPS.q4x16_matmul_silu(gate_up, q4, n, isa, 0), OPS.q4x16_matmul(act, q4, n, isa, 0)
    )
    assert torch.equal(
        OPS.q8x16_matmul_silu(gate_up, q8, q8_scales, n, isa),
        OPS.q8x16_matmul(act, q8, q8_scales, n, isa),
    )
