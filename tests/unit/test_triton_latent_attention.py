"""The Triton latent attention kernels (pagoda/kernels/latent_attention.py) against the dense
float64 reference of tests/latent_cases.py: decode split or not, over float32 and int8 caches,
and LatentAttention.forward on the triton backend (the rows written by Triton, decodes and
prefill chunks in one step). Compiled on a GPU (benchmarks/gpu.sh tests-kernels), in Triton's
interpreter without one. Float32 dots: rtol 1e-4, atol 1e-5 (test_triton_attention.py's).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.triton_interpreter import interpreter_as_gpu  # noqa: E402, F401 (a fixture, by name)

pytestmark = pytest.mark.usefixtures("interpreter_as_gpu")

from pagoda.kernels.latent_attention import latent_decode_attention  # noqa: E402
from pagoda.kernels.paged_cache import KVCache  # noqa: E402
from pagoda.layers.forward_context import ForwardContext  # noqa: E402
from pagoda.layers.latent_attention import LatentAttention  # noqa: E402
from pagoda.runner.step_inputs import build_attention_metadata  # noqa: E402
from tests.latent_cases import DECODES, MIXED, close, make_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("quant", [None, torch.int8], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", ["tiny", "odd", "v3-shape"])
def test_triton_decode_matches_the_dense_reference(
    name: str, splits: int, quant: torch.dtype | None
) -> None:
    case = DECODES[name]
    s = make_step(case, 4, quant)
    dev = torch.device(DEVICE)
    cache = KVCache(*(t.to(dev) for t in s.cache.tensors()))
    q = s.q.to(dev)
    out = torch.full((q.shape[0], case.heads, case.rank), float("nan"), device=dev)
    token_idx = torch.arange(q.shape[0], device=dev)
    latent_decode_attention(
        q, out, cache, token_idx, s.tables.to(dev), s.lens.to(dev), s.scale, splits
    )
    close(out.cpu(), s.expected, rtol=1e-4)


@pytest.mark.parametrize("quant", [None, torch.int8], ids=str)
@pytest.mark.parametrize("name", ["mixed", "odd-mixed", "v3-prompt"])
def test_triton_layer_matches_the_dense_reference(name: str, quant: torch.dtype | None) -> None:
    """LatentAttention.forward on the triton backend: the step's rows written by Triton, then
    decodes and prefill chunks in one step."""
    case = MIXED[name]
    s = make_step(case, 5, quant)
    dev = torch.device(DEVICE)
    cache = KVCache(*(t.to(dev) for t in s.cache.tensors()))
    meta = build_attention_metadata(
        case.query_lens, case.seq_lens, s.tables.tolist(), case.block_size, dev
    )
    layer = LatentAttention(case.heads, case.rank, s.scale, 0)
    layer.backend = "triton"
    out = layer(s.q.to(dev), s.rows.to(dev), ForwardContext(meta, [cache]))
    close(out.cpu(), s.expected, rtol=1e-4)
