"""pagoda's CPU paged decode attention (pagoda/kernels/cpu/paged_attention.cpp) over each KV cache
dtype it reads as stored: float32 in place, bfloat16 and int8 (with a scale per token and kv
head) converted a chunk of positions at a time.

One decode step's attention over every layer of a model shape (default Qwen2.5-1.5B: 28 layers,
12 query heads, 2 kv heads of 128), each layer its own cache, so the step streams the whole
cache from memory as a real step does. The dtypes run in turn, --rounds times; per dtype the
median milliseconds a step, its range, the cache bytes read and the GB/s that makes. Nothing
here is a peer comparison: it says what the cache dtype saves the attention.

    python benchmarks/kv_cache_attention.py --context 8192 --batch 1 \\
        --output-json benchmarks/results/issue42/part3/kv_attention_qwen1.5b_8k.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from pagoda.bench.common import write_json
from pagoda.bench.machine import machine_record, pagoda_version
from pagoda.bench.roofline import read_bandwidth_gb_s
from pagoda.kernels.cpu import built
from pagoda.layers.kv_cache import quantize_kv

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
BLOCK = 16


def _caches(dtype: torch.dtype, args: argparse.Namespace) -> list[tuple[Any, ...]]:
    """One (k, v, k_scale, v_scale) per layer, random rows stored in `dtype`."""
    blocks = args.batch * args.context // BLOCK
    shape = (blocks, BLOCK, args.kv_heads, args.head_dim)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.layers):
        k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        if dtype == torch.int8:
            (kq, ks), (vq, vs) = quantize_kv(k, dtype), quantize_kv(v, dtype)
            out.append((kq, vq, ks, vs))
        else:
            out.append((k.to(dtype), v.to(dtype), None, None))
    return out


def _step_ms(ops: Any, caches: list[tuple[Any, ...]], args: argparse.Namespace) -> float:
    """One timed pass over every layer (the best of 3, each from memory: 28 layers' caches)."""
    tables = torch.arange(args.batch * args.context // BLOCK, dtype=torch.int32)
    tables = tables.view(args.batch, -1)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    q = torch.randn(args.batch, args.heads, args.head_dim)
    scale = args.head_dim**-0.5
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for k, v, ks, vs in caches:
            ops.paged_decode_attention(q, k, v, tables, lens, scale, 0, 2, 0, ks, vs)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    ops = built()
    if ops is None:
        print("pagoda's CPU kernels cannot be built here", file=sys.stderr)
        return 1
    times: dict[str, list[float]] = {name: [] for name in DTYPES}
    sizes: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, dtype in DTYPES.items():  # in turn, so drift hits every dtype alike
            caches = _caches(dtype, args)
            sizes[name] = sum(t.nbytes for c in caches for t in c if t is not None)
            times[name].append(_step_ms(ops, caches, args))
            del caches
    rows = {}
    for name, ms in times.items():
        median = statistics.median(ms)
        rows[name] = {
            "step_ms_median": round(median, 2),
            "step_ms_range": [round(min(ms), 2), round(max(ms), 2)],
            "cache_mb": round(sizes[name] / 1e6, 1),
            "cache_gb_s": round(sizes[name] / median / 1e6, 2),
            "vs_float32": round(statistics.median(times["float32"]) / median, 2),
        }
        print(f"{name:9s} {median:7.1f} ms a step ({min(ms):.1f}-{max(ms):.1f}), "
              f"{sizes[name] / 1e6:6.1f} MB, {rows[name]['cache_gb_s']:5.1f} GB/s, "
              f"{rows[name]['vs_float32']:.2f}x float32")  # fmt: skip
    record = {
        "bench": "kv_cache_attention",
        "shape": {
            k: getattr(args, k)
            for k in ("context", "batch", "layers", "heads", "kv_heads", "head_dim")
        },
        "rounds": args.rounds,
        "method": "dtypes in turn each round; per round the best of 3 passes over every layer",
        "machine": machine_record()
        | {"read_bandwidth_gb_s": round(read_bandwidth_gb_s(torch.device("cpu")), 2)},
        "pagoda": pagoda_version(),
        "dtypes": rows,
    }
    if args.output_json:
        write_json(record, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
