"""race.cpp's race_sample, the sampler's draw for rows without a seed on CPU: the same tokens on
every instruction set (scalar, AVX2, AVX-512) whatever the threads, goodness of fit to
softmax(logits / T) at >= 100k draws (a wrong temperature caught), dropped (-inf) tokens never
drawn, and the Sampler's use of it: seeded rows keep the torch path's tokens, unseeded ones
reproduce under torch.manual_seed. Skipped where the extension cannot be built (no compiler)."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.cpu import built
from pagoda.runner.sampler import Sampler, SamplingMetadata
from tests.unit.test_rejection_sampler import chi2_sf

OPS = built()
pytestmark = pytest.mark.skipif(OPS is None, reason="the CPU kernels cannot be built here")
CHUNK = 8192  # race.cpp's split of a row


def race(
    logits: torch.Tensor, temperature: torch.Tensor | None, seed: int, isa: int = 2
) -> torch.Tensor:
    inv = None if temperature is None else temperature.reciprocal()
    return OPS.race_sample(logits, inv, torch.tensor(seed), isa)


def test_every_path_draws_the_same_tokens() -> None:
    """The noise is integer arithmetic and exp / log the same polynomials with explicit fmas,
    so a token is the same on every path; a vocabulary of two chunks and a partial block covers
    the merge and the padded tail, a row-strided view the stride, 1 and 2 threads the split."""
    torch.manual_seed(0)
    wide = torch.randn(5, 2 * CHUNK + 37 + 3) * 4
    logits = wide[:, : 2 * CHUNK + 37]
    logits[1, : CHUNK + 5] = float("-inf")
    temperature = torch.tensor([0.6, 1.0, 1.7, 0.05, 1e-4])
    threads = torch.get_num_threads()
    for seed in range(40):
        got = [race(logits, temperature, seed, isa) for isa in (0, 1, 2)]
        assert torch.equal(got[0], got[1]) and torch.equal(got[1], got[2]), seed
        torch.set_num_threads(1)
        try:
            assert torch.equal(race(logits.contiguous(), temperature, seed), got[2])
        finally:
            torch.set_num_threads(threads)
        assert int(got[2][1]) > CHUNK + 4
        assert int(got[2][4]) == int(logits[4].argmax())  # T = 1e-4: the max, nothing else


def chi2_p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of `tokens` to `probs` over the tokens with p > 0 (an even count)."""
    keep = probs > 0
    observed = torch.bincount(tokens, minlength=probs.shape[0]).double()[keep]
    expected = probs.double()[keep] * tokens.shape[0]
    assert expected.min() >= 50
    return chi2_sf(float(((observed - expected) ** 2 / expected).sum()), int(keep.sum()) - 1)


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_draws_fit_the_softmax_and_a_wrong_temperature_is_caught(temperature: float) -> None:
    """120k draws (60 calls of 2,000 rows: each row its own noise) over 16 tokens of which one is
    dropped (-inf, never drawn): the fit to softmax(logits / T) holds at p > 1e-3, and the same
    counts against softmax(logits / (1.1 T)) fail at p < 1e-6."""
    torch.manual_seed(1)
    logits = torch.randn(16) * 1.2
    logits[4] = float("-inf")
    rows = logits.expand(2000, 16).contiguous()
    temp = torch.full((2000,), temperature)
    tokens = torch.cat([race(rows, temp, seed) for seed in range(60)])
    assert int((tokens == 4).sum()) == 0
    assert chi2_p_value(tokens, (logits / temperature).softmax(-1)) > 1e-3
    assert chi2_p_value(tokens, (logits / (1.1 * temperature)).softmax(-1)) < 1e-6


def test_rows_and_seeds_draw_different_noise() -> None:
    """Equal logits in every row: each row's draw is its own (not one noise for all rows), and
    a new seed draws anew."""
    rows = torch.zeros(256, 1000)
    first = race(rows, None, 7)
    assert len(set(first.tolist())) > 200
    assert int((race(rows, None, 8) == first).sum()) < 10
    assert torch.equal(race(rows, None, 7), first)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(RuntimeError, match="float32"):
        OPS.race_sample(torch.zeros(2, 8, dtype=torch.float64), None, torch.tensor(0), 2)
    with pytest.raises(RuntimeError, match="inv_temperature"):
        OPS.race_sample(torch.zeros(2, 8), torch.ones(3), torch.tensor(0), 2)
    with pytest.raises(RuntimeError, match="seed"):
        OPS.race_sample(torch.zeros(2, 8), None, torch.tensor([1, 2]), 2)


def _meta(rows: int, seeds: dict[int, int], top_k: int | None = None) -> SamplingMetadata:
    return SamplingMetadata(
        all_greedy=False,
        all_random=True,
        is_greedy=None,
        temperature=torch.full((rows,), 0.8),
        top_k=None if top_k is None else torch.full((rows,), top_k, dtype=torch.int64),
        top_p=None,
        min_p=None,
        presence_penalties=None,
        frequency_penalties=None,
        repetition_penalties=None,
        generators={row: torch.Generator().manual_seed(s) for row, s in seeds.items()},
        max_num_logprobs=None,
        max_top_k=top_k or 0,
    )


@pytest.mark.parametrize("top_k", [None, 5])
def test_sampler_keeps_seeded_rows_on_their_own_noise(
    top_k: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows 1 and 4 seeded among 8: their tokens over 30 steps are the torch path's
    (PAGODA_CPU_KERNELS=0), the unseeded rows' reproduce under torch.manual_seed, and top-k's
    dropped tokens are never drawn."""
    torch.manual_seed(3)
    logits = [torch.randn(8, 300) * 3 for _ in range(30)]
    seeds = {1: 11, 4: 12}

    def run() -> torch.Tensor:
        meta = _meta(8, seeds, top_k)
        torch.manual_seed(0)
        return torch.stack([Sampler()(x, meta).sampled_token_ids for x in logits])

    fused = run()
    assert torch.equal(run(), fused)
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "0")
    plain = run()
    assert torch.equal(fused[:, [1, 4]], plain[:, [1, 4]])
    assert not torch.equal(fused, plain)  # the unseeded rows draw race.cpp's noise
    if top_k is not None:
        kept = torch.stack([x.topk(top_k, dim=-1).indices for x in logits])  # (30, 8, k)
        assert bool((kept == fused.unsqueeze(-1)).any(-1).all())
