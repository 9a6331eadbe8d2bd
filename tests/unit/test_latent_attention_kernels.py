"""Multi-head latent attention (DeepSeek's MLA, absorbed form) over a latent paged cache on CPU
against the dense float64 reference of tests/latent_cases.py: LatentAttention's torch path (SDPA
over the gathered rows, the reference the kernels are held to, over float32, int8 and fp8
caches), the C++ ops with `value_dim` (paged_attention.cpp, every instruction set this CPU has;
skipped where they cannot be built), and LatentAttention.forward on them, which also writes the
step's rows. The Triton kernels: tests/unit/test_triton_latent_attention.py.

Tolerances are the attention tests': float32 sums of a few hundred terms, 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.cpu import built
from pagoda.layers.forward_context import ForwardContext
from pagoda.layers.latent_attention import LatentAttention
from tests.latent_cases import CASES, DECODES, Case, Step, close, make_step

OPS = built()
ISAS = [] if OPS is None else list(range(OPS.isa() + 1))
needs_ops = pytest.mark.skipif(OPS is None, reason="the CPU kernels cannot be built here")


def _forward(step: Step, case: Case, backend: str, cpu_kernel: bool) -> torch.Tensor:
    """LatentAttention.forward of the step (its rows written again, as a model step writes)."""
    layer = LatentAttention(case.heads, case.rank, step.scale, 0)
    layer.backend, layer.cpu_kernel = backend, cpu_kernel
    return layer(step.q, step.rows, ForwardContext(step.meta, [step.cache]))


# ---- the torch path ------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", [None, torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_torch_path_matches_the_dense_reference(name: str, quant: torch.dtype | None) -> None:
    step = make_step(CASES[name], 1, quant)
    close(_forward(step, CASES[name], "torch", False), step.expected)


# ---- the C++ CPU ops -----------------------------------------------------------------------------


@needs_ops
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", list(DECODES))
def test_cpu_decode_matches_the_dense_reference(threads: int, isa: int, name: str) -> None:
    assert OPS is not None
    case, s = DECODES[name], make_step(DECODES[name])
    out = OPS.paged_decode_attention(
        s.q, s.cache.k, s.cache.v, s.tables, s.lens, s.scale, 0, isa, case.rank
    )
    close(out, s.expected)


@needs_ops
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_rows_match_the_reference_and_keep_their_decode_bits(
    threads: int, isa: int, name: str
) -> None:
    """Every row of a mixed step is close to the reference and the bits of
    paged_decode_attention of that row alone at its position (the determinism contract)."""
    assert OPS is not None
    case, s = CASES[name], make_step(CASES[name], 2)
    k, v = s.cache.k, s.cache.v
    out = OPS.paged_attention(s.q, k, v, s.tables, s.starts, s.lens, s.scale, 0, isa, case.rank)
    close(out, s.expected)
    for r, (q_len, seq_len) in enumerate(zip(case.query_lens, case.seq_lens, strict=True)):
        for i in range(q_len):
            t = int(s.starts[r]) + i
            length = torch.tensor([seq_len - q_len + i + 1], dtype=torch.int32)
            alone = OPS.paged_decode_attention(
                s.q[t : t + 1], k, v, s.tables[r : r + 1], length, s.scale, 0, isa, case.rank
            )
            assert torch.equal(out[t : t + 1], alone), (r, i)


@needs_ops
@pytest.mark.parametrize("name", ["tiny", "mixed", "v3-prompt"])
def test_the_layer_on_the_cpu_kernels_matches_its_torch_path(name: str) -> None:
    case = CASES[name]
    step = make_step(case, 3)
    close(_forward(step, case, "torch", True), _forward(step, case, "torch", False))


@needs_ops
def test_cpu_ops_refuse_a_latent_call_they_cannot_take() -> None:
    assert OPS is not None
    s = make_step(DECODES["tiny"])
    args = (s.q, s.cache.k, s.cache.v, s.tables, s.lens, s.scale, 0, 2)
    with pytest.raises(RuntimeError, match="value_dim"):
        OPS.paged_decode_attention(*args, 49)  # past the row's 48 values
    full_v = torch.zeros_like(s.cache.k)
    with pytest.raises(RuntimeError, match="v_cache empty"):
        OPS.paged_decode_attention(s.q, s.cache.k, full_v, *args[3:], 32)
    with pytest.raises(RuntimeError, match="the same shape"):
        OPS.paged_decode_attention(*args)  # value_dim 0 with the empty values
