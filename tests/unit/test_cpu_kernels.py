"""pagoda's CPU kernels (pagoda/kernels/cpu): each quantized matmul against its torch reference
over the GGUF formats (Q4_0, Q4_1, Q4_K, Q8_0) and int8 rows, odd shapes, every instruction set
this CPU has (scalar, AVX2, AVX-512 VNNI) and 1 or 2 threads. Skipped where the extension cannot
be built (no compiler): pagoda then runs on torch's ops.

Two references: the exact one (the activations quantized as the kernel does, then a float64
matmul against the dequantized weights) within float32 rounding, and the plain one (float
activations) within the bound the int8 activations allow: half a quantization step of each
group times the group's |w| sum."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pagoda.kernels.cpu import built
from pagoda.layers import gguf
from pagoda.layers.quant_forms import pack_nibbles, quantize_int8_rows

OPS = built()
pytestmark = pytest.mark.skipif(OPS is None, reason="the CPU kernels cannot be built here")
ISAS = [] if OPS is None else list(range(OPS.isa() + 1))


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _blocks(qtype: str, rows: int, cols: int, seed: int) -> gguf.GGUFWeight:
    """Random GGUF blocks with finite fp16 scales."""
    per_block, nbytes = gguf._BLOCK_BYTES[qtype]
    rng = np.random.default_rng(seed)
    n = rows * cols // per_block
    raw = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    fields = 2 if qtype in ("Q4_1", "Q4_K") else 1  # (d, m) / (d, dmin) or d
    scales = rng.uniform(0.001, 0.02, size=(n, fields)).astype(np.float16)
    raw[:, : 2 * fields] = scales.view(np.uint8).reshape(n, 2 * fields)
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


def _run(qtype: str, x: torch.Tensor, weight: gguf.GGUFWeight, isa: int) -> torch.Tensor:
    assert OPS is not None
    g = gguf.decode(weight)
    if qtype == "Q8_0":
        return OPS.q8_matmul(x, g.codes.to(torch.int8).contiguous(), g.scale.contiguous(), isa)
    assert g.offset is not None
    return OPS.q4_matmul(x, pack_nibbles(g.codes), g.scale.contiguous(), g.offset.contiguous(), isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 37, 256), (3, 64, 512), (5, 1538, 256), (9, 20, 768)]
)
def test_gguf_formats_match_the_reference(
    threads: int, isa: int, qtype: str, m: int, n: int, k: int
) -> None:
    weight = _blocks(qtype, n, k, seed=m * 1000 + n)
    w = weight.dequantize()  # the gguf package's own decoding
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    y = _run(qtype, x, weight, isa)
    assert y.shape == (m, n) and y.dtype == torch.float32
    exact = _activations(x) @ w.double().T
    scale = exact.abs().amax().item()
    torch.testing.assert_close(y.double(), exact, rtol=0, atol=2e-6 * scale + 1e-6)
    plain = (x.double() @ w.double().T - y.double()).abs()
    assert (plain <= _bound(x, w) * 1.001 + 1e-5).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 6])
def test_int8_rows_match_the_reference(threads: int, isa: int, m: int) -> None:
    assert OPS is not None
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(203, 576, generator=gen)  # an LM head's shape: rows not in 4s or 16s
    codes, scale = quantize_int8_rows(w)
    x = torch.randn(m, 576, generator=gen)
    y = OPS.q8_matmul(x, codes, scale[:, None].contiguous(), isa)
    wq = codes.double() * scale.double()[:, None]
    exact = _activations(x) @ wq.T
    torch.testing.assert_close(y.double(), exact, rtol=0, atol=2e-6 * exact.abs().amax().item())


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


def test_shapes_it_cannot_take_are_refused() -> None:
    assert OPS is not None
    with pytest.raises(RuntimeError, match="multiple of 32"):
        OPS.q8_matmul(torch.randn(1, 40), torch.zeros(4, 40, dtype=torch.int8), torch.ones(4, 1), 2)
    with pytest.raises(RuntimeError, match="scale shape"):
        OPS.q8_matmul(torch.randn(1, 64), torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 3), 2)


def test_torch_compile_keeps_the_op_in_its_graph() -> None:
    assert OPS is not None
    codes, scale = quantize_int8_rows(torch.randn(16, 64))
    s = scale[:, None].contiguous()

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pagoda_cpu.q8_matmul(x * 2, codes, s, 2) + 1

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    x = torch.randn(2, 64)
    torch.testing.assert_close(compiled(x), f(x))
