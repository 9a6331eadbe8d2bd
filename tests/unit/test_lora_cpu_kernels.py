"""pagoda_cpu.lora_apply (kernels/cpu/lora.cpp) against layers/lora.py's lora_reference: one
token or many, slots in runs and alternating, skipped tokens (-1, or a slot past the table's),
one slice or uneven ones (an empty one among them), ranks and widths off the vector widths, B
(S, N, R) contiguous or stored by rank (LoRAWeights' layout) with the same bits, every instruction set this CPU has, 1 or 2 threads, A and B float32, bfloat16 or float16 (x and
y float32); lora_apply's and LoRAWeights' routing to it, and a compiled call. Skipped where the extension cannot be built (no compiler): pagoda then runs the reference.

Tolerance: the kernel and the reference sum in different orders, so both are checked against
the float64 product within float32 rounding of such a sum: h's dot products over K and the
expand's over R each err by at most (their length) * 2^-24 * their sum of |terms|, and the add
into y by 2^-24 * |y|, which (K + R + 2) * 2^-24 * (|y| + |B| (|A| |x|)) bounds. bfloat16 and
float16 A and B are exact in float32 and float64, and the kernel widens them exactly, so the
bound is the same, taken for the stored values."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagoda.kernels.cpu import SWITCH, built
from pagoda.layers.lora import LoRAWeights, lora_apply, lora_reference

OPS = built()
pytestmark = pytest.mark.skipif(OPS is None, reason="the CPU kernels cannot be built here")
ISAS = [] if OPS is None else list(range(OPS.isa() + 1))
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]

# (tokens, K, R, slots in the table, slice edges; the last is N)
SHAPES = [
    (1, 64, 8, 1, [0, 40]),
    (1, 1000, 16, 4, [0, 5, 21, 37]),
    (37, 77, 12, 3, [0, 13, 20, 50]),
    (37, 256, 16, 4, [0, 96]),
    (9, 33, 3, 2, [0, 0, 9]),
    (64, 96, 64, 2, [0, 300, 340, 701]),
]


def _slots(tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """A request's tokens in a run of one slot, then decodes alternating over the slots, with
    tokens of the base model alone (-1) and of a slot past the table's among them."""
    run = tokens // 2
    slots = [int(torch.randint(num_slots, (1,), generator=gen))] * run
    slots += [i % (num_slots + 1) for i in range(tokens - run)]  # 0, 1, ..., S - 1, S, 0, ...
    slots = [-1 if s == num_slots else s for s in slots]
    if tokens > 8:
        slots[-2] = num_slots  # past the table: skipped, as the reference skips it
    return torch.tensor(slots, dtype=torch.int64)


def _case(
    tokens: int,
    k: int,
    rank: int,
    num_slots: int,
    offsets: list[int],
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    n, slices = offsets[-1], len(offsets) - 1
    x = torch.randn(tokens, k, generator=gen)
    a = torch.randn(num_slots, slices, rank, k, generator=gen) / k**0.5
    b = torch.randn(num_slots, n, rank, generator=gen)
    y = torch.randn(tokens, n, generator=gen)
    return y, x, a.to(dtype), b.to(dtype), _slots(tokens, num_slots, gen), offsets


def _exact(case: Case, absolute: bool = False) -> torch.Tensor:
    """y + each token's B (A x) in float64 (of the absolute values: the rounding's scale)."""
    y, x, a, b = (t.double().abs() if absolute else t.double() for t in case[:4])
    slots, offsets = case[4:]
    out = y.clone()
    for t, s in enumerate(slots.tolist()):
        if not 0 <= s < a.shape[0]:
            continue
        h = a[s] @ x[t]  # (L, R)
        for i, (o0, o1) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
            out[t, o0:o1] += b[s, o0:o1] @ h[i]
    return out


def _check(got: torch.Tensor, case: Case) -> None:
    x, rank = case[1], case[2].shape[2]
    bound = (x.shape[1] + rank + 2) * 2.0**-24 * _exact(case, absolute=True)
    assert ((got.double() - _exact(case)).abs() <= bound).all()


def _kernel(case: Case, isa: int) -> torch.Tensor:
    assert OPS is not None
    y, x, a, b, slots, offsets = case
    out = y.clone()
    OPS.lora_apply(out, x, a, b, slots, offsets, isa)
    return out


def _by_rank(b: torch.Tensor) -> torch.Tensor:
    """b's values stored by rank: the (S, N, R) transpose of a contiguous (S, R, N) tensor."""
    return b.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-K{s[1]}-R{s[2]}-L{len(s[4]) - 1}")
def test_lora_apply_matches_the_reference(
    threads: int, isa: int, shape: Any, dtype: torch.dtype
) -> None:
    case = _case(*shape, seed=len(shape[4]) * 100 + shape[0], dtype=dtype)
    got = _kernel(case, isa)
    reference = case[0].clone()
    lora_reference(reference, *case[1:])
    _check(got, case)
    _check(reference, case)
    skipped = (case[4] < 0) | (case[4] >= case[2].shape[0])
    assert skipped.any() == (shape[0] > 1)
    assert torch.equal(got[skipped], case[0][skipped])  # untouched, bit for bit
    # Widened exactly: the bits of the float32 copies, but for the AVX2 path's last K % 8
    # products, a scalar loop the compiler vectorizes (fusing some products) as it sees fit.
    if dtype != torch.float32 and (isa != 1 or shape[1] % 8 == 0):
        widened = (*case[:2], case[2].float(), case[3].float(), *case[4:])
        assert torch.equal(got, _kernel(widened, isa))  # type: ignore[arg-type]
    # B stored by rank (LoRAWeights' layout: read in place, widths off the vector widths through
    # the partial-block path): the same bits.
    by_rank = (*case[:3], _by_rank(case[3]), *case[4:])
    assert torch.equal(_kernel(by_rank, isa), got)  # type: ignore[arg-type]


def test_a_b_in_another_layout_is_refused() -> None:
    assert OPS is not None
    y, x, a, b, slots, offsets = _case(9, 64, 8, 2, [0, 24, 40], seed=17)
    strided = torch.randn(2, 40, 16)[:, :, ::2]  # (S, N, R), neither layout
    with pytest.raises(RuntimeError, match="b \\(S, N, R\\) contiguous or the transpose"):
        OPS.lora_apply(y, x, a, strided, slots, offsets, ISAS[-1])
    routed = y.clone()
    lora_apply(routed, x, a, strided, slots, offsets)  # lora_apply takes the reference instead
    reference = y.clone()
    lora_reference(reference, x, a, strided, slots, offsets)
    assert torch.equal(routed, reference)


@pytest.mark.parametrize("isa", ISAS)
def test_a_token_gets_the_same_bits_alone_and_in_a_batch(threads: int, isa: int) -> None:
    case = _case(37, 77, 12, 3, [0, 13, 20, 50], seed=5)
    batch = _kernel(case, isa)
    y, x, a, b, slots, offsets = case
    for t in range(x.shape[0]):
        alone = _kernel((y[t : t + 1], x[t : t + 1], a, b, slots[t : t + 1], offsets), isa)
        assert torch.equal(alone[0], batch[t])


def test_lora_apply_runs_the_kernel_for_float32_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    y, x, a, b, slots, offsets = _case(37, 256, 16, 4, [0, 40, 96], seed=3)
    routed = y.clone()
    lora_apply(routed, x, a, b, slots, offsets)
    assert torch.equal(routed, _kernel((y, x, a, b, slots, offsets), ISAS[-1]))
    half = y.bfloat16()  # not float32: the reference
    lora_apply(half, x.bfloat16(), a.bfloat16(), b.bfloat16(), slots, offsets)
    expected = y.bfloat16()
    lora_reference(expected, x.bfloat16(), a.bfloat16(), b.bfloat16(), slots, offsets)
    assert torch.equal(half, expected)
    monkeypatch.setenv(SWITCH, "0")  # the kernels turned off: the reference
    switched_off = y.clone()
    lora_apply(switched_off, x, a, b, slots, offsets)
    reference = y.clone()
    lora_reference(reference, x, a, b, slots, offsets)
    assert torch.equal(switched_off, reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_a_and_b_with_float32_activations_run_the_kernel(dtype: torch.dtype) -> None:
    """lora_apply and LoRAWeights.add_to run the kernel for bfloat16 / float16 a and b and float32
    x and y (the kernel's bits); a and b of two dtypes go to the reference."""
    y, x, a, b, slots, offsets = _case(9, 64, 8, 2, [0, 24, 40], seed=13, dtype=dtype)
    expected = _kernel((y, x, a, b, slots, offsets), ISAS[-1])
    routed = y.clone()
    lora_apply(routed, x, a, b, slots, offsets)
    assert torch.equal(routed, expected)
    layer = LoRAWeights(2, offsets, 8, 64, slots, dtype)
    assert layer.cpu_kernel and layer.b.transpose(1, 2).is_contiguous()  # stored by rank
    layer.a.copy_(a)
    layer.b.copy_(b)
    assert torch.equal(layer.add_to(y.clone(), x), expected)
    mixed = y.clone()
    lora_apply(mixed, x, a, b.float(), slots, offsets)
    reference = y.clone()
    lora_reference(reference, x, a, b.float(), slots, offsets)
    assert torch.equal(mixed, reference)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_call_keeps_the_op_and_gives_eager_s_result(backend: str) -> None:
    """dynamo traces lora_apply through (the op in its graph, its fake for the shapes; aot_eager
    functionalizes its write to y) and the compiled call writes what the eager one writes."""
    y, x, a, b, slots, offsets = _case(9, 64, 8, 2, [0, 24, 40], seed=11)

    def step(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        lora_apply(y, x * 2, a, b, slots, offsets)
        return y + 1

    eager_y, compiled_y = y.clone(), y.clone()
    eager = step(eager_y, x)
    compiled = torch.compile(step, fullgraph=True, backend=backend)(compiled_y, x)
    assert torch.equal(compiled, eager)
    assert torch.equal(compiled_y, eager_y)
    assert not torch.equal(eager_y, y)
