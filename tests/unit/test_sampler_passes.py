"""How many times the Sampler goes over the (rows, vocab) logits, per feature mix.

For a large vocabulary a step's sampling is bound by memory traffic over (R, V) tensors (Qwen3
at 256 rows: 156 MB per float32 pass), so every aten op that reads or writes a tensor of R * V
elements counts as a pass, and its bytes (inputs read, outputs written) are added up in units
of one float32 (R, V) tensor. Views, allocations and (R,)-sized work are free; so is an op that
touches only the elements an index names. The logits come as the LM head gives them on a GPU,
in bfloat16. The bounds are today's counts: a change that adds a pass fails here. BOUNDS are the
torch path's (PAGODA_CPU_KERNELS=0, the GPU's); KERNEL_BOUNDS the CPU's, where the rows without
a seed of their own run race.cpp's race_sample, one read of the logits that counts as one op.

Before the sampler's passes were cut (W1, temperature 0.6: widen, divide, softmax, uniform, log,
negate, divide, argmax), the same table read 8 passes, 14.5 tensors for W1; 2 and 2.5 for greedy;
23 and 43.25 for penalties; 10 and 18.5 for logit bias with min_tokens.

As a script, prints the table: python tests/unit/test_sampler_passes.py
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagoda.kernels.cpu import built
from pagoda.runner.input_batch import BatchColumns, InputBatch, SamplingRows
from pagoda.runner.sampler import Sampler, SamplingMetadata, random_sample
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.messages import NewRequestData, ScheduledRequest, SchedulerOutput

R, V = 8, 4096
EOS = 2
FREE = {"empty", "empty_like", "empty_strided", "view", "_unsafe_view", "unsqueeze", "expand",
        "slice", "select", "alias", "detach", "as_strided", "t", "transpose", "lift_fresh",
        "new_full", "new_zeros", "new_ones", "new_empty"}  # fmt: skip
WRITE_ONLY = {"uniform_", "fill_", "zero_", "exponential_", "normal_", "full", "full_like"}
# Touch only the elements an index names: a pass only when they build a whole new tensor.
SPARSE = {"gather", "index_put", "index_put_", "index", "scatter_add_"}


class PassCounter(TorchDispatchMode):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.ops: Counter[str] = Counter()
        self.traffic = 0.0  # in float32 (R, V) tensors

    def _full(self, x: Any) -> list[torch.Tensor]:
        if isinstance(x, torch.Tensor) and x.numel() >= self.numel:
            return [x]
        if isinstance(x, (list, tuple)):
            return [t for item in x for t in self._full(item)]
        return []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in FREE:
            return out
        read = [] if name in WRITE_ONLY else self._full(list(args) + list(kwargs.values()))
        written = self._full(out)
        if name in SPARSE and (name.endswith("_") or not written):
            read = written = []
        if read or written:
            self.ops[name] += 1
            size = 4 * self.numel
            self.traffic += sum(t.numel() * t.element_size() for t in read + written) / size
        return out


SCENARIOS: dict[str, list[SamplingParams]] = {
    "greedy": [SamplingParams(temperature=0.0)] * R,
    "greedy + logprobs": [SamplingParams(temperature=0.0, logprobs=5)] * R,
    "random (W1: temperature 0.6)": [SamplingParams(temperature=0.6)] * R,
    "random, seeded": [SamplingParams(temperature=0.6, seed=i) for i in range(R)],
    "greedy and random rows": [SamplingParams(temperature=0.6 * (i % 2)) for i in range(R)],
    "top-k, top-p, min-p": [SamplingParams(top_k=50, top_p=0.9, min_p=0.05)] * R,
    "penalties": [
        SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5)
    ]
    * R,
    "repetition penalty only": [SamplingParams(repetition_penalty=1.2)] * R,
    "logit bias + min_tokens": [SamplingParams(logit_bias={5: 2.0}, min_tokens=16)] * R,
}


def _step(params: list[SamplingParams]) -> tuple[InputBatch, SamplingRows, BatchColumns]:
    """A persistent batch of one request per params (prompts of 10 tokens, i outputs), as the
    runner holds it, and the rows that sample in a decode step."""
    batch, rows = InputBatch(V, capacity=len(params)), SamplingRows()
    for i, p in enumerate(params):
        outputs = [(7 * i + j) % V for j in range(i)]
        prompt = [(3 * i + j) % V for j in range(10)]
        batch.apply(
            SchedulerOutput(0, [], new_requests=[NewRequestData(f"r{i}", prompt, outputs, p, [])])
        )
        s = ScheduledRequest(f"r{i}", [0], 10 + i, i, sample_ids=[f"r{i}"], sample_indices=[0])
        rows.add(s, batch.rows[f"r{i}"], i)
    return batch, rows, BatchColumns.gather(batch, rows, torch.device("cpu"))


def count(params: list[SamplingParams], dtype: torch.dtype = torch.bfloat16) -> PassCounter:
    """The passes of one step's sampling from the LM head's output in `dtype`:
    SamplingMetadata.from_batch (its gathers of the penalty state), then the Sampler."""
    batch, rows, columns = _step(params)
    gens = {
        i: torch.Generator().manual_seed(p.seed) for i, p in enumerate(params) if p.seed is not None
    }
    logits = torch.randn(len(params), V).to(dtype)
    counter = PassCounter(R * V)
    with counter:
        meta = SamplingMetadata.from_batch(columns, batch, rows, gens, [EOS])
        Sampler()(logits, meta)
    return counter


# name -> (passes, traffic in float32 (R, V) tensors) from bfloat16 logits, at most: torch path
BOUNDS = {
    "greedy": (1, 0.5),  # argmax straight from the LM head's output
    "greedy + logprobs": (6, 6.5),
    "random (W1: temperature 0.6)": (6, 11.5),
    "random, seeded": (5, 10.5),
    "greedy and random rows": (7, 12.0),
    "top-k, top-p, min-p": (20, 39.75),
    "penalties": (18, 33.5),
    "repetition penalty only": (14, 24.25),
    "logit bias + min_tokens": (6, 11.5),
}
# The same with race.cpp (CPU): W1 widens, then races; the seeded rows keep the torch path.
KERNEL_BOUNDS = {
    "greedy": (1, 0.5),
    "greedy + logprobs": (6, 6.5),
    "random (W1: temperature 0.6)": (2, 2.5),
    "random, seeded": (5, 10.5),
    "greedy and random rows": (3, 3.0),
    "top-k, top-p, min-p": (16, 30.75),
    "penalties": (14, 24.5),
    "repetition penalty only": (10, 15.25),
    "logit bias + min_tokens": (2, 2.5),
}


def _assert_within(counter: PassCounter, bound: tuple[int, float]) -> None:
    passes, traffic = bound
    assert sum(counter.ops.values()) <= passes, counter.ops
    assert counter.traffic <= traffic + 1e-9, counter.ops


@pytest.mark.parametrize("name", list(BOUNDS))
def test_passes_over_the_logits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "0")
    _assert_within(count(SCENARIOS[name]), BOUNDS[name])


@pytest.mark.skipif(built() is None, reason="the CPU kernels cannot be built here")
@pytest.mark.parametrize("name", list(KERNEL_BOUNDS))
def test_passes_over_the_logits_with_the_cpu_race(name: str) -> None:
    counter = count(SCENARIOS[name])
    _assert_within(counter, KERNEL_BOUNDS[name])
    if SCENARIOS[name][0].temperature > 0 and SCENARIOS[name][0].seed is None:
        assert counter.ops["race_sample"] == 1, counter.ops


def test_16_bit_logits_sample_as_their_float32_widening() -> None:
    """Every path widens 16-bit logits in its first pass: the same tokens and logprobs as the
    float32 logits the LM head used to hand over."""
    logits = (torch.randn(R, V) * 4).to(torch.bfloat16)
    logits[:, :64] = 0.0  # exact ties, and zeros
    for name, params in SCENARIOS.items():
        with_logprobs = [dataclasses.replace(p, logprobs=3) for p in params]
        for ps in (params, with_logprobs):
            outs = []
            for x in (logits, logits.float()):
                batch, rows, columns = _step(ps)
                gens = {i: torch.Generator().manual_seed(i) for i, p in enumerate(ps) if p.seed}
                meta = SamplingMetadata.from_batch(columns, batch, rows, gens, [EOS])
                torch.manual_seed(0)
                outs.append(Sampler()(x, meta))
            assert torch.equal(outs[0].sampled_token_ids, outs[1].sampled_token_ids), name
            if outs[0].logprobs is not None:
                assert all(map(torch.equal, outs[0].logprobs, outs[1].logprobs)), name


def test_the_race_without_negation_has_the_same_winner() -> None:
    """random_sample's argmin(probs / log U) against the race as written, argmax(probs / -log U),
    on the same noise: every winner equal, exact ties and zero probabilities included."""
    torch.manual_seed(0)
    probs = torch.randn(64, 512).mul(3).softmax(-1)
    probs[:, 100:200] = probs[:, 100:101]
    probs[:8] = 0.0
    probs[:8, 3] = probs[:8, 7] = 0.5
    for seed in range(20):
        torch.manual_seed(seed)
        got = random_sample(probs, {})
        torch.manual_seed(seed)
        noise = torch.empty_like(probs).uniform_().log_().neg_()
        assert torch.equal(got, (probs / noise).argmax(-1))


if __name__ == "__main__":  # PAGODA_CPU_KERNELS=0 for the torch path's table
    for dtype in (torch.bfloat16, torch.float32):
        print(f"logits from the LM head in {dtype}")
        for name, params in SCENARIOS.items():
            c = count(params, dtype)
            ops = ", ".join(f"{k} {v}" if v > 1 else k for k, v in sorted(c.ops.items()))
            print(f"  {name:30s} {sum(c.ops.values()):3d} passes {c.traffic:5.2f} x fp32: {ops}")
