"""The fused small-batch linear kernel (pagoda/kernels/fused_linear.py) against its reference,
under the Triton interpreter when there is no GPU: the unfused layer's steps (RMSNorm, linear,
residual add, SiLU-and-mul) in torch, rounded to the dtype at the same points, the matmul in
float32. Inputs: 1, 5 and 16 rows, strided x rows, K and N not multiples of the tiles.

Tolerances, from what differs (measured under the interpreter, 3 seeds, over these cases):
- float32: the dot's float32 accumulation order (K-tile by K-tile) and the norm's reduction
  order; rtol = atol = 2e-5 (measured max |diff| below 4e-6 at outputs of magnitude ~10-20).
- bfloat16 / float16: the same float32 sums rounded to the dtype: within one ulp (a sum near a
  rounding tie may round the other way) or, at small outputs whose ulp is finer than the float32
  sums' own error, within that error (2e-5, as float32); bit-exact for >= 97% of outputs
  (measured: at most 1 ulp in bf16, at most 8 ulps of outputs below 1e-3 in fp16; 99.7% of bf16
  and 98.6% of fp16 outputs bit-exact in the worst case).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tests.triton_interpreter import check_interpreted, interpreter_as_gpu  # noqa: E402, F401

check_interpreted()
pytestmark = pytest.mark.usefixtures("interpreter_as_gpu")

from pagoda.kernels.fused_linear import MAX_ROWS, fused_linear  # noqa: E402
from pagoda.layers.norm import RMSNorm  # noqa: E402
from tests.unit.test_triton_kernels import _strided, _ulps  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6


def _reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    silu_mul: bool,
) -> torch.Tensor:
    dtype = x.dtype
    if norm_weight is not None:
        norm = RMSNorm(x.shape[1], EPS, dtype).to(x.device)
        with torch.no_grad():
            norm.weight.copy_(norm_weight)
        x = norm(x)
    y32 = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if silu_mul:
        gate, up = (t.to(dtype).float() for t in y32.chunk(2, dim=-1))
        return (gate / (1.0 + torch.exp(-gate)) * up).to(dtype)
    y = y32.to(dtype)
    if residual is not None:
        y = (y.float() + residual.float()).to(dtype)
    return y


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        return
    ulps = _ulps(got, want)
    near = (got.float() - want.float()).abs() <= 2e-5
    assert bool(((ulps <= 1) | near).all())
    assert float((ulps == 0).float().mean()) >= 0.97


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS])
@pytest.mark.parametrize(
    "form", ["plain", "bias", "norm", "norm_bias", "add", "add_bias", "silu", "norm_silu_bias"]
)
def test_fused_linear_matches_reference(form: str, rows: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rows)
    k, n = 200, 72  # one full K tile and a masked one; two full N tiles and a masked one
    silu = "silu" in form
    x = _strided(rows, k, dtype, pad=3) * 2
    weight = (torch.randn(2 * n if silu else n, k, device=DEVICE) / k**0.5).to(dtype)
    bias = torch.randn(weight.shape[0], device=DEVICE).to(dtype) if "bias" in form else None
    norm_weight = (1 + torch.randn(k, device=DEVICE) / 4).to(dtype) if "norm" in form else None
    residual = _strided(rows, n, dtype, pad=5) * 4 if "add" in form else None
    norm = None if norm_weight is None else (norm_weight, EPS)
    got = fused_linear(x, weight, bias, norm=norm, residual=residual, silu_mul=silu)
    _assert_close(got, _reference(x, weight, bias, norm_weight, residual, silu))


def test_fused_linear_contract() -> None:
    x = torch.randn(MAX_ROWS + 1, 32, device=DEVICE)
    w = torch.randn(16, 32, device=DEVICE)
    with pytest.raises(AssertionError, match="at most 16 rows"):
        fused_linear(x, w)
    assert fused_linear(x[:0], w).shape == (0, 16)
