"""The CPU paged attention of this tree against another commit's, in one process: the other
commit's kernels/cpu/paged_attention.cpp (and the headers it includes) is built as a library of
its own (namespace pagoda_cpu renamed pagoda_before, so both load side by side), and every case
runs both kernels alternately, --rounds times, on the same inputs. The JSON holds each case's
median times, the median and quartiles of the per-round ratios (before / after), and whether the
outputs are the same bits (they must be: a row's bits are part of the determinism promise).

One process, because this 2-vCPU machine moves 20-40% from one run to the next: separate
processes cannot show a 10% change, alternate calls in one process can.

    python benchmarks/attention_ab.py --before 2fda2f0 --output-json ab.json
    python benchmarks/attention_ab.py --before 7fd6fe5 --only none --engine-rounds 8

With --engine-rounds, also W-CPU's shape through one engine (the embedded SmolLM2 or --model,
-O0 so that the layers call the attention from Python): 64 requests, prompts and outputs of
U[16, 256] tokens, greedy, EOS ignored, each round's requests run once with each build's
attention (the order alternating), output tokens a second and the same tokens asserted.

Cases (no model file needed; random queries and caches in the models' shapes, SmolLM2's 9 / 3
heads 64 wide and Qwen2.5-1.5B's 12 / 2 heads 128 wide): one prefill step of a served burst
(prompts of U[16, 256] tokens filling the 2,048-token budget, as prefill_attention.py's burst),
a 512-token prompt, 64 decode rows of 300 positions, one decode row of 256 and of 8,192, and
64 decode rows of 300 positions over every layer of the model (30 or 28 caches of 29-34 MB, so
that each layer's keys and values come from memory, as in a model's decode step, where the
other cases' fit in the last-level cache).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.common import write_json
from pagoda.bench.machine import machine_record, pagoda_version

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("paged_attention.cpp", "common.h", "kv_rows.h")
SHAPES = {"smollm2": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128)}
LAYERS = {"smollm2": 30, "qwen2.5-1.5b": 28}
# (paged_attention's arguments less isa, one tuple per call of a round; multiply-adds in all)
Case = tuple[list[tuple[Any, ...]], float]


def build_before(rev: str, workdir: Path) -> Any:
    """torch.ops.pagoda_before: commit rev's paged attention, built apart."""
    src = workdir / "src"
    src.mkdir(parents=True)
    for name in SOURCES:
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:pagoda/kernels/cpu/{name}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        text = text.replace("TORCH_LIBRARY_FRAGMENT(pagoda_cpu", "TORCH_LIBRARY(pagoda_cpu")
        (src / name).write_text(text.replace("pagoda_cpu", "pagoda_before"))
    from torch.utils import cpp_extension

    out = workdir / "build"
    out.mkdir()
    cpp_extension.load(
        name="pagoda_attention_before",
        sources=[str(src / "paged_attention.cpp")],
        extra_cflags=["-O3", "-fopenmp", "-std=c++17"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        build_directory=str(out),
    )
    return torch.ops.pagoda_before


def _cache(blocks: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (blocks, 16, kv_heads, dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def burst_case(heads: int, kv_heads: int, dim: int, tokens: int = 2048) -> Case:
    rng = random.Random(0)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(min(rng.randint(16, 256), tokens - sum(lens)))
    blocks = [-(-n // 16) for n in lens]
    first = [0, *itertools.accumulate(blocks)]
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    for i, b in enumerate(blocks):
        table[i, :b] = torch.arange(first[i], first[i] + b, dtype=torch.int32)
    k, v = _cache(first[-1], kv_heads, dim, 0)
    q = torch.randn(sum(lens), heads, dim, generator=torch.Generator().manual_seed(1))
    starts = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    macs = sum(n * (n + 1) / 2 for n in lens) * heads * dim * 2
    return [(q, k, v, table, starts, seq, dim**-0.5, 0)], macs


def prompt_case(heads: int, kv_heads: int, dim: int, n: int) -> Case:
    blocks = -(-n // 16)
    k, v = _cache(blocks, kv_heads, dim, 2)
    q = torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(3))
    table = torch.arange(blocks, dtype=torch.int32)[None]
    starts = torch.tensor([0, n], dtype=torch.int32)
    seq = torch.tensor([n], dtype=torch.int32)
    return [(q, k, v, table, starts, seq, dim**-0.5, 0)], n * (n + 1) / 2 * heads * dim * 2


def decode_case(
    heads: int, kv_heads: int, dim: int, batch: int, length: int, layers: int = 1
) -> Case:
    """batch rows of `length` positions; with several layers, each its own cache and queries,
    and the rows' blocks spread over the pool in a random order (as requests' blocks interleave
    in an engine's pool)."""
    blocks = -(-length // 16)
    gen = torch.Generator().manual_seed(5)
    order = torch.arange(blocks * batch) if layers == 1 else torch.randperm(blocks * batch)
    table = order.to(torch.int32).view(batch, blocks)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    seq = torch.full((batch,), length, dtype=torch.int32)
    calls = []
    for layer in range(layers):
        k, v = _cache(blocks * batch, kv_heads, dim, 4 + layer)
        q = torch.randn(batch, heads, dim, generator=gen)
        calls.append((q, k, v, table, starts, seq, dim**-0.5, 0))
    return calls, layers * batch * length * heads * dim * 2


def cases() -> dict[str, Callable[[], Case]]:
    """Each case's inputs, made when it runs."""
    out: dict[str, Callable[[], Case]] = {}
    for model, shape in SHAPES.items():
        out[f"{model} burst step"] = lambda s=shape: burst_case(*s)
        out[f"{model} prompt 512"] = lambda s=shape: prompt_case(*s, 512)
        out[f"{model} decode 64 x 300"] = lambda s=shape: decode_case(*s, 64, 300)
        out[f"{model} decode 1 x 256"] = lambda s=shape: decode_case(*s, 1, 256)
        out[f"{model} decode 1 x 8192"] = lambda s=shape: decode_case(*s, 1, 8192)
        out[f"{model} decode 64 x 300, {LAYERS[model]} layers"] = lambda s=shape, n=LAYERS[model]: (
            decode_case(*s, 64, 300, n)
        )
    return out


def _run_all(ops: Any, calls: list[tuple[Any, ...]], isa: int) -> list[torch.Tensor]:
    return [ops.paged_attention(*args, isa) for args in calls]


def compare(after: Any, before: Any, case: Case, isa: int, rounds: int) -> dict[str, Any]:
    calls, macs = case
    outs = zip(_run_all(after, calls, isa), _run_all(before, calls, isa), strict=True)
    same = all(torch.equal(a, b) for a, b in outs)
    t_after, t_before, ratios = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        _run_all(before, calls, isa)
        t1 = time.perf_counter()
        _run_all(after, calls, isa)
        t2 = time.perf_counter()
        t_before.append(t1 - t0)
        t_after.append(t2 - t1)
        ratios.append((t1 - t0) / (t2 - t1))
    quartiles = statistics.quantiles(ratios, n=4)
    return {
        "isa": isa,
        "bits_equal": same,
        "after_ms": round(statistics.median(t_after) * 1e3, 4),
        "before_ms": round(statistics.median(t_before) * 1e3, 4),
        "after_g_mac_s": round(macs / statistics.median(t_after) / 1e9, 1),
        "before_over_after_median": round(statistics.median(ratios), 3),
        "before_over_after_quartiles": [round(quartiles[0], 3), round(quartiles[2], 3)],
    }


def engine_rounds(model: str | None, before: Any, rounds: int) -> list[dict[str, Any]]:
    """W-CPU's shape through one -O0 engine, the layers' attention from each build in turn."""
    from pagoda import LLM, SamplingParams
    from pagoda.layers import attention

    llm = LLM(model, optimization_level=0, enable_prefix_caching=False)
    after = attention.cpu_paged_attention
    sides = {"after": after, "before": functools.partial(after, ops=before)}
    out = []
    for r in range(rounds):
        rng = random.Random(r)
        prompts = [
            {"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(rng.randint(16, 256))]}
            for _ in range(64)
        ]
        params = [
            SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 256), ignore_eos=True)
            for _ in range(64)
        ]
        rates, tokens = {}, {}
        for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
            attention.cpu_paged_attention = sides[side]  # type: ignore[assignment]
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            tokens[side] = [o.outputs[0].token_ids for o in outputs]
            rates[side] = sum(map(len, tokens[side])) / elapsed
        attention.cpu_paged_attention = sides["after"]  # type: ignore[assignment]
        row = {
            "round": r,
            "after_output_tok_s": round(rates["after"], 1),
            "before_output_tok_s": round(rates["before"], 1),
            "after_over_before": round(rates["after"] / rates["before"], 3),
            "same_tokens": tokens["after"] == tokens["before"],
        }
        print(row, flush=True)
        out.append(row)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--only", default="", help="cases whose name holds this")
    parser.add_argument("--engine-rounds", type=int, default=0, help="W-CPU's shape, see above")
    parser.add_argument("--model", default=None, help="the engine rounds' GGUF (default SmolLM2)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    from pagoda.kernels.cpu import built

    after = built()
    if after is None:
        print("needs pagoda's CPU kernels (a C++ compiler)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        before = build_before(args.before, Path(tmp))
        rows = []
        for name, make in cases().items():
            if args.only not in name:
                continue
            case = make()
            for isa in range(after.isa(), 0, -1):
                row = {"case": name, **compare(after, before, case, isa, args.rounds)}
                print(row, flush=True)
                rows.append(row)
        engine = engine_rounds(args.model, before, args.engine_rounds) if args.engine_rounds else []
    record = {
        "benchmark": "attention_ab",
        "method": (
            "one process, the two builds called alternately on the same inputs each round; "
            "ratio = before / after per round, median and quartiles over the rounds"
        ),
        "before": args.before,
        "after": pagoda_version(),
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "machine": machine_record(),
        "rows": rows,
    }
    if engine:
        ratios = [r["after_over_before"] for r in engine]
        record["engine"] = {
            "workload": "64 requests, prompts and outputs U[16, 256] tokens, greedy, -O0",
            "model": args.model or "embedded SmolLM2",
            "after_over_before_median": round(statistics.median(ratios), 3),
            "after_over_before_range": [min(ratios), max(ratios)],
            "rounds": engine,
        }
    if args.output_json:
        write_json(record, args.output_json)
    same = all(r["bits_equal"] for r in rows) and all(r["same_tokens"] for r in engine)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
