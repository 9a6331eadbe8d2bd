"""The float LM head's transposed form for a few rows on CPU (layers/embedding.py) against
F.linear, its reference: the same dot products summed in another order (float32, K = 576: a
few ulps of logits of magnitude ~25; atol 1e-4 as the determinism rule's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.layers.embedding import _TRANSPOSED_ROWS, LMHead


@pytest.mark.parametrize("rows", [1, 2, 5, 32, 33])
def test_float_lm_head_matches_f_linear(rows: int) -> None:
    torch.manual_seed(rows)
    head = LMHead(1000, 576, torch.float32)
    with torch.no_grad():
        head.weight.normal_()
    hidden = torch.randn(rows + 3, 576)[3:]  # a view at an offset, as hidden[rows] is
    got = head(hidden)
    assert got.is_contiguous() and got.shape == (rows, 1000)
    torch.testing.assert_close(got, F.linear(hidden, head.weight), rtol=0, atol=1e-4)
    assert (rows in _TRANSPOSED_ROWS) == (2 <= rows <= 32)
