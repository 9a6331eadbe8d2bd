"""The batched LoRA kernels (pagoda/kernels/lora.py) against `lora_reference`, under the Triton
interpreter when there is no GPU. Slot layouts: one token (with an adapter, and without), a
decode-like batch of 5 tokens of mixed slots and -1 in one token block, prefill-like runs that
cross token blocks, 40 tokens of random slots, and 150 tokens (the large token blocks); one
slice with R = 16 and K = 100 (one K split), three uneven slices with R = 8 (padded to 16) and
K = 300 (three K splits, the last tile masked).

Tolerances, from what differs: the kernels sum the same float32 products as the reference in
another order (K tile by K tile, then the splits), and round at the same points (the
interpreter's tl.dot is a float32 matmul whatever its input_precision: the expand's tf32x3 is
tests/gpu/test_lora_gpu.py's).
- float32: rtol = atol = 2e-5 (measured max |diff| below 1e-5 at outputs of magnitude ~10).
- bfloat16: y's new value is round(y + round(delta)) in both, from float32 deltas that agree to
  ~1e-6 relative, so either rounding may go the other way near a tie: |diff| <= one ulp of the
  delta plus one of the result, bounded by 2^-7 (|delta| + |y_new|) (a bf16 ulp is at most
  2^-7 of its value; the delta's ulp counts when y and delta cancel: measured 8 ulps of a
  result of 0.31 from y = -3.2), + 2e-5 for outputs near zero; bit-exact for >= 97% of outputs
  (measured: over 99.9%).
Rows of tokens without an adapter are untouched, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.triton_interpreter import check_interpreted, interpreter_as_gpu  # noqa: E402, F401

check_interpreted()
pytestmark = pytest.mark.usefixtures("interpreter_as_gpu")

from pagoda.kernels.lora import SMALL_T, lora_apply_triton, num_splits  # noqa: E402
from pagoda.layers.lora import lora_reference  # noqa: E402
from tests.unit.test_triton_kernels import _ulps  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_SLOTS = 3


def _runs(*runs: tuple[int, int]) -> list[int]:
    """(slot, length) runs -> one slot per token."""
    return [slot for slot, length in runs for _ in range(length)]


LAYOUTS = {
    "one": [1],
    "one_none": [-1],
    "decode": [2, -1, 0, 2, 1],
    "prefill_runs": _runs((1, 17), (-1, 9), (0, 14)),
    "random": torch.randint(
        -1, NUM_SLOTS, (40,), generator=torch.Generator().manual_seed(0)
    ).tolist(),  # fmt: skip
    "large_blocks": _runs((2, 70), (0, 30), (-1, 20), (1, 30)),
}
# name: (K, offsets, R)
SHAPES = {"L1_R16": (100, [0, 72], 16), "L3_R8": (300, [0, 40, 56, 100], 8)}


def _inputs(
    slots: list[int], k: int, offsets: list[int], rank: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    t, n, num_slices = len(slots), offsets[-1], len(offsets) - 1
    y = (torch.randn(t, n, device=DEVICE) * 2).to(dtype)
    x = torch.randn(t, k, device=DEVICE).to(dtype)
    a = (torch.randn(NUM_SLOTS, num_slices, rank, k, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(NUM_SLOTS, n, rank, device=DEVICE).to(dtype)
    return y, x, a, b, torch.tensor(slots, dtype=torch.int64, device=DEVICE)


def _assert_close(got: torch.Tensor, want: torch.Tensor, delta: torch.Tensor) -> None:
    """delta: the reference's product alone (added to zeros), in y's dtype."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        return
    bound = 2.0**-7 * (delta.float().abs() + want.float().abs()) + 2e-5
    assert bool(((got.float() - want.float()).abs() <= bound).all())
    assert float((_ulps(got, want) == 0).float().mean()) >= 0.97


def _reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    offsets: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y + the products, the products alone), by lora_reference."""
    want, delta = y.clone(), torch.zeros_like(y)
    lora_reference(want, x, a, b, slots, offsets)
    lora_reference(delta, x, a, b, slots, offsets)
    return want, delta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_matches_reference(layout: str, shape: str, dtype: torch.dtype) -> None:
    torch.manual_seed(len(layout))
    k, offsets, rank = SHAPES[shape]
    y, x, a, b, slots = _inputs(LAYOUTS[layout], k, offsets, rank, dtype)
    want, delta = _reference(y, x, a, b, slots, offsets)
    got = y.clone()
    lora_apply_triton(got, x, a, b, slots, offsets)
    none = slots < 0
    assert torch.equal(got[none], y[none])
    _assert_close(got, want, delta)


def test_lora_strided_x_and_empty_slice() -> None:
    """x rows with a stride, a slice of width 0; the splits and token blocks the cases above
    exercise."""
    torch.manual_seed(0)
    slots = LAYOUTS["decode"]
    y, x, a, b, slots_t = _inputs(slots, 100, [0, 30, 30, 64], 16, torch.float32)
    x = torch.cat([x, x], dim=1)[:, 3:103]
    want, delta = _reference(y, x, a, b, slots_t, [0, 30, 30, 64])
    lora_apply_triton(y, x, a, b, slots_t, [0, 30, 30, 64])
    _assert_close(y, want, delta)
    assert num_splits(1, 1, 100) == 1 and num_splits(40, 3, 300) == 3
    assert len(LAYOUTS["large_blocks"]) > SMALL_T
    lora_apply_triton(y[:0], x[:0], a, b, slots_t[:0], [0, 30, 30, 64])  # T = 0: nothing
