"""The batched LoRA kernels (pagoda/kernels/lora.py) compiled for the GPU (skipped without CUDA):
`lora_apply` on CUDA tensors against `lora_reference` at the real projection shapes of
Qwen2-1.5B (K up to 8,960, N up to 17,920), ranks 8 / 16 / 64, in a mixed step (decode tokens of
mixed slots and -1, then prefill runs); captured in a CUDA graph and replayed on new slots and
inputs, as eager. tests/unit/test_triton_lora.py runs the same kernels in the interpreter.

Tolerances, from what differs: the kernels sum the reference's float32 products in another
order (on tensor cores; the expand's tf32x3 products carry ~2^-21 relative error) and round at
the same points.
- bfloat16 / float16: y's new value is round(y + round(delta)) in both; either rounding may go
  the other way near a tie: |diff| <= 2^-7 (bf16) / 2^-10 (fp16) (|delta| + |y_new|) (one ulp of
  the delta and one of the result), + 1e-4 max |delta| for outputs near zero (float32 sums of
  up to 8,960 products: relative error ~ sqrt(K) 2^-24 ~ 6e-6 of the terms' scale, with a
  margin); bit-exact for >= 95% of outputs.
- float32: |diff| <= 1e-5 |y_new| + 1e-4 max |delta| (the same float32 sums).
Rows of tokens without an adapter are untouched, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.layers.lora import lora_apply, lora_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_SLOTS = 4
# Qwen2-1.5B's projections: (K, offsets)
SHAPES = {
    "qkv": (1536, [0, 1536, 1792, 2048]),
    "o": (1536, [0, 1536]),
    "gate_up": (1536, [0, 8960, 17920]),
    "down": (8960, [0, 1536]),
}
_REL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-5}


def _mixed_step(generator: torch.Generator) -> torch.Tensor:
    """37 decode tokens of random slots (-1 included), then prefill runs: 600 tokens of slot 2,
    300 without an adapter, 211 of slot 0."""
    decode = torch.randint(-1, NUM_SLOTS, (37,), generator=generator)
    runs = [torch.full((n,), s) for s, n in ((2, 600), (-1, 300), (0, 211))]
    return torch.cat([decode, *runs]).cuda()


def _inputs(
    slots: torch.Tensor, k: int, offsets: list[int], rank: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    t, n, num_slices = slots.shape[0], offsets[-1], len(offsets) - 1
    y = (torch.randn(t, n, device="cuda") * 2).to(dtype)
    x = torch.randn(t, k, device="cuda").to(dtype)
    a = (torch.randn(NUM_SLOTS, num_slices, rank, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(NUM_SLOTS, n, rank, device="cuda").to(dtype)
    return y, x, a, b


def _assert_close(got: torch.Tensor, want: torch.Tensor, delta: torch.Tensor) -> None:
    diff = (got.float() - want.float()).abs()
    scale = 1e-4 * float(delta.float().abs().max())
    if got.dtype == torch.float32:
        bound = _REL[got.dtype] * want.abs() + scale
    else:
        bound = _REL[got.dtype] * (delta.float().abs() + want.float().abs()) + scale
    assert bool((diff <= bound).all()), f"max excess {float((diff - bound).max())}"
    if got.dtype != torch.float32:
        assert float((got == want).float().mean()) >= 0.95


@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_lora_real_shapes(shape: str, rank: int) -> None:
    generator = torch.Generator().manual_seed(rank)
    torch.manual_seed(rank)
    k, offsets = SHAPES[shape]
    slots = _mixed_step(generator)
    y, x, a, b = _inputs(slots, k, offsets, rank, torch.bfloat16)
    for t in (1, 5, 37, slots.shape[0]):  # one token, decode, the decode part, the whole step
        want, delta = y[:t].clone(), torch.zeros_like(y[:t])
        lora_reference(want, x[:t], a, b, slots[:t], offsets)
        lora_reference(delta, x[:t], a, b, slots[:t], offsets)
        got = y[:t].clone()
        lora_apply(got, x[:t], a, b, slots[:t], offsets)
        none = slots[:t] < 0
        assert torch.equal(got[none], y[:t][none])
        _assert_close(got, want, delta)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_lora_other_dtypes(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    k, offsets = SHAPES["qkv"]
    slots = _mixed_step(torch.Generator().manual_seed(0))
    y, x, a, b = _inputs(slots, k, offsets, 16, dtype)
    want, delta = y.clone(), torch.zeros_like(y)
    lora_reference(want, x, a, b, slots, offsets)
    lora_reference(delta, x, a, b, slots, offsets)
    lora_apply(y, x, a, b, slots, offsets)
    _assert_close(y, want, delta)


@pytest.mark.parametrize("num_tokens", [5, 300])
def test_lora_graph_replay_equals_eager(num_tokens: int) -> None:
    """No host sync: captured once with one step's slots, replayed after new slots and inputs
    are written into the same buffers, as eager on those."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(num_tokens)
    k, offsets = SHAPES["qkv"]
    slots = torch.randint(-1, NUM_SLOTS, (num_tokens,), generator=generator).cuda()
    y0, x, a, b = _inputs(slots, k, offsets, 16, torch.bfloat16)
    y = y0.clone()
    for _ in range(2):  # compile, settle the allocator
        lora_apply(y, x, a, b, slots, offsets)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_apply(y, x, a, b, slots, offsets)
    new_slots = torch.cat([torch.full((num_tokens // 2,), 3), torch.full((num_tokens,), -1)])
    slots.copy_(new_slots[:num_tokens].roll(1))
    x.copy_(torch.randn_like(x))
    y.copy_(y0)
    graph.replay()
    torch.cuda.synchronize()
    want = y0.clone()
    lora_apply(want, x, a, b, slots, offsets)
    assert torch.equal(y, want)
    changed = (y != y0).any(dim=1)
    assert torch.equal(changed, slots >= 0)


def test_lora_apply_runs_the_triton_kernel_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagoda.kernels.lora as kernels

    calls = []
    triton_apply = kernels.lora_apply_triton
    monkeypatch.setattr(kernels, "lora_apply_triton", lambda *a: calls.append(triton_apply(*a)))
    k, offsets = SHAPES["o"]
    slots = torch.tensor([0, -1, 3], device="cuda")
    y, x, a, b = _inputs(slots, k, offsets, 8, torch.bfloat16)
    lora_apply(y, x, a, b, slots, offsets)
    assert len(calls) == 1
