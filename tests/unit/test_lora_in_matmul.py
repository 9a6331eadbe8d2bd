"""The quantized matmul ops' optional lora_* arguments (kernels/cpu/lora.h): the adapters'
products taken inside the matmul's call give, bit for bit, the matmul's output plus
pagoda_cpu.lora_apply's (the op test_lora_cpu_kernels.py checks against the reference), for the
nibble and 8-bit forms, the norm and activation prologues, one token or many, one slot or
several with skipped tokens, every instruction set this CPU has, 1 or 2 threads, A and B
float32, bfloat16 or float16, B contiguous or stored by rank; malformed arguments are refused; a compiled call keeps the op;
and a Linear layer with adapters (layers/linear.py) computes what its matmul plus
LoRAWeights.add_to compute, in forward, after_norm and after_act."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagoda.kernels.cpu import built
from pagoda.layers.activation import SiluAndMul
from pagoda.layers.cpu_forms import cpu_matmul, pack_q4x16, pack_q8x16, set_cpu_q4
from pagoda.layers.linear import Linear, MergedLinear
from pagoda.layers.lora import LoRAWeights
from pagoda.layers.norm import RMSNorm

OPS = built()
pytestmark = pytest.mark.skipif(OPS is None, reason="the CPU kernels cannot be built here")
ISAS = [] if OPS is None else list(range(OPS.isa() + 1))
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (tokens, K (a multiple of 32), N, R, slots in the table, slice edges (the last is N))
SHAPES = [
    (1, 64, 40, 8, 1, [0, 40]),
    (1, 256, 200, 16, 2, [0, 128, 160, 200]),
    (37, 96, 50, 12, 3, [0, 13, 20, 50]),
    (64, 128, 701, 16, 4, [0, 300, 340, 701]),
]


def _weights(n: int, k: int, gen: torch.Generator) -> dict[str, Any]:
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02
    offset = -torch.rand(n, k // 32, generator=gen) * 0.1
    q8, q8_scales = pack_q8x16(
        torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8),
        torch.rand(n, k // 32, generator=gen) * 0.01,
    )
    return {"q4": pack_q4x16(codes, scale, offset), "q8": q8, "q8_scales": q8_scales}


def _adapters(shape: Any, dtype: torch.dtype, gen: torch.Generator) -> tuple[Any, ...]:
    tokens, k, n, rank, num_slots, offsets = shape
    a = torch.randn(num_slots, len(offsets) - 1, rank, k, generator=gen) / k**0.5
    b = torch.randn(num_slots, n, rank, generator=gen)
    slots = torch.randint(-1, num_slots + 1, (tokens,), generator=gen)  # -1, S: skipped
    slots[0] = 0
    return a.to(dtype), b.to(dtype), slots, offsets


def _plus_lora(y: torch.Tensor, x: torch.Tensor, lora: tuple[Any, ...], isa: int) -> torch.Tensor:
    """y, with lora_apply's products added in place."""
    assert OPS is not None
    OPS.lora_apply(y, x, *lora, isa)
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-K{s[1]}-N{s[2]}-S{s[4]}")
def test_the_matmuls_add_lora_apply_s_bits(
    threads: int, isa: int, shape: Any, dtype: torch.dtype
) -> None:
    assert OPS is not None
    tokens, k, n = shape[:3]
    gen = torch.Generator().manual_seed(tokens * 1000 + n)
    w = _weights(n, k, gen)
    lora = _adapters(shape, dtype, gen)
    x = torch.randn(tokens, k, generator=gen)
    q4 = OPS.q4x16_matmul(x, w["q4"], n, isa, 0, *lora)
    assert torch.equal(q4, _plus_lora(OPS.q4x16_matmul(x, w["q4"], n, isa, 0), x, lora, isa))
    q8 = OPS.q8x16_matmul(x, w["q8"], w["q8_scales"], n, isa, *lora)
    base = OPS.q8x16_matmul(x, w["q8"], w["q8_scales"], n, isa)
    assert torch.equal(q8, _plus_lora(base.clone(), x, lora, isa))
    assert not torch.equal(q8, base)  # the adapters added something
    # B stored by rank (LoRAWeights' layout: prefetched between the tiles rank by rank, read in
    # place by the expand): the same bits.
    a, b, slots, offsets = lora
    by_rank = b.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(OPS.q4x16_matmul(x, w["q4"], n, isa, 0, a, by_rank, slots, offsets), q4)


@pytest.mark.parametrize("isa", ISAS)
def test_the_prologues_give_the_adapters_the_normed_and_activated_rows(
    threads: int, isa: int
) -> None:
    assert OPS is not None
    shape = (9, 64, 72, 8, 2, [0, 24, 72])
    gen = torch.Generator().manual_seed(7)
    w = _weights(72, 64, gen)
    lora = _adapters(shape, torch.bfloat16, gen)
    x, residual = torch.randn(9, 64, generator=gen), torch.randn(9, 64, generator=gen)
    weight = torch.rand(64, generator=gen) + 0.5
    y, hidden = OPS.q4x16_matmul_norm(x, residual, weight, 1e-6, w["q4"], 72, isa, 0, *lora)
    normed, expected_hidden = OPS.add_rms_norm(x, residual, weight, 1e-6, isa)
    expected = _plus_lora(OPS.q4x16_matmul(normed, w["q4"], 72, isa, 0), normed, lora, isa)
    assert torch.equal(y, expected) and torch.equal(hidden, expected_hidden)
    y8, _ = OPS.q8x16_matmul_norm(x, None, weight, 1e-6, w["q8"], w["q8_scales"], 72, isa, *lora)
    normed = OPS.rms_norm(x, weight, 1e-6, isa)
    base = OPS.q8x16_matmul(normed, w["q8"], w["q8_scales"], 72, isa)
    assert torch.equal(y8, _plus_lora(base, normed, lora, isa))
    gate_up = torch.randn(9, 128, generator=gen)
    act = OPS.silu_and_mul(gate_up, isa)
    y = OPS.q4x16_matmul_silu(gate_up, w["q4"], 72, isa, 0, *lora)
    assert torch.equal(y, _plus_lora(OPS.q4x16_matmul(act, w["q4"], 72, isa, 0), act, lora, isa))
    y8 = OPS.q8x16_matmul_silu(gate_up, w["q8"], w["q8_scales"], 72, isa, *lora)
    base = OPS.q8x16_matmul(act, w["q8"], w["q8_scales"], 72, isa)
    assert torch.equal(y8, _plus_lora(base, act, lora, isa))


def test_malformed_lora_arguments_are_refused() -> None:
    assert OPS is not None
    shape = (3, 64, 40, 8, 2, [0, 40])
    gen = torch.Generator().manual_seed(3)
    w = _weights(40, 64, gen)
    a, b, slots, offsets = _adapters(shape, torch.float32, gen)
    x = torch.randn(3, 64, generator=gen)
    with pytest.raises(RuntimeError, match="all or none"):
        OPS.q4x16_matmul(x, w["q4"], 40, 2, 0, a, None, slots, offsets)
    with pytest.raises(RuntimeError, match="b must be"):
        OPS.q4x16_matmul(x, w["q4"], 40, 2, 0, a, b[:, :20], slots, offsets)
    with pytest.raises(RuntimeError, match="slots must be"):
        OPS.q4x16_matmul(x, w["q4"], 40, 2, 0, a, b, slots[:2], offsets)
    with pytest.raises(RuntimeError, match="offsets"):
        OPS.q8x16_matmul(x, w["q8"], w["q8_scales"], 40, 2, a, b, slots, [0, 41])


def test_a_compiled_call_keeps_the_op_and_gives_eager_s_result() -> None:
    assert OPS is not None
    shape = (5, 64, 40, 8, 2, [0, 16, 40])
    gen = torch.Generator().manual_seed(5)
    w = _weights(40, 64, gen)
    lora = _adapters(shape, torch.bfloat16, gen)

    def step(x: torch.Tensor) -> torch.Tensor:
        return OPS.q4x16_matmul(x * 2, w["q4"], 40, 2, 0, *lora) + 1

    x = torch.randn(5, 64, generator=gen)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(compiled, step(x))


def _with_adapters(layer: Linear, offsets: list[int], gen: torch.Generator) -> LoRAWeights:
    slots = torch.tensor([0, -1, 1, 0, 1], dtype=torch.int64)
    lora = LoRAWeights(2, offsets, 8, layer.input_size, slots, torch.bfloat16)
    lora.a.copy_(torch.randn(lora.a.shape, generator=gen) / layer.input_size**0.5)
    lora.b.copy_(torch.randn(lora.b.shape, generator=gen))
    assert lora.cpu_kernel
    layer.lora = lora
    return lora


def _q4_layer(layer: Linear, gen: torch.Generator) -> Linear:
    n, k = layer.output_size, layer.input_size
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02
    assert set_cpu_q4(layer, codes, scale, -torch.rand(n, k // 32, generator=gen) * 0.1)
    return layer


def test_a_layer_s_adapters_join_its_matmul_s_call() -> None:
    gen = torch.Generator().manual_seed(11)
    layer = _q4_layer(MergedLinear(64, {"gate": 48, "up": 48}), gen)
    lora = _with_adapters(layer, [0, 48, 96], gen)
    x = torch.randn(5, 64, generator=gen)
    expected = lora.add_to(cpu_matmul(layer, x), x)
    assert torch.equal(layer(x), expected)
    norm = RMSNorm(64, eps=1e-6)
    norm.cpu_kernel = True  # as the runner sets it where the kernels are built
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    residual = torch.randn(5, 64, generator=gen)
    y, hidden = layer.after_norm(x, residual, norm)
    normed, expected_hidden = norm(x, residual)
    assert torch.equal(y, lora.add_to(cpu_matmul(layer, normed), normed))
    assert torch.equal(hidden, expected_hidden)
    down = _q4_layer(Linear(96, 32), gen)
    down_lora = _with_adapters(down, [0, 32], gen)
    act = SiluAndMul()
    act.cpu_kernel = True
    gate_up = torch.randn(5, 192, generator=gen)
    activated = act(gate_up)
    expected = down_lora.add_to(cpu_matmul(down, activated), activated)
    assert torch.equal(down.after_act(gate_up, act), expected)
