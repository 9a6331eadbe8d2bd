"""The CPU paged attention of this tree against another commit's, in one process: the other
commit's kernels/cpu/paged_attention.cpp (and the headers it includes) is built as a library of
its own (namespace pagoda_cpu renamed pagoda_before, so both load side by side), and every case
runs both kernels alternately, --rounds times, on the same inputs. The JSON holds each case's
median times, the median and quartiles of the per-round ratios (before / after), and whether the
outputs are the same bits (they must be: a row's bits are part of the determinism promise).

One process, because this 2-vCPU machine moves 20-40% from one run to the next: separate
processes cannot show a 10% change, alternate calls in one process can.

    python benchmarks/attention_ab.py --before 2fda2f0 --output-json ab.json

Cases (no model file needed; random queries and caches in the models' shapes, SmolLM2's 9 / 3
heads 64 wide and Qwen2.5-1.5B's 12 / 2 heads 128 wide): one prefill step of a served burst
(prompts of U[16, 256] tokens filling the 2,048-token budget, as prefill_attention.py's burst),
a 512-token prompt, 64 decode rows of 300 positions, one decode row of 256 and of 8,192.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.common import write_json
from pagoda.bench.machine import machine_record, pagoda_version

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("paged_attention.cpp", "common.h", "kv_rows.h")
SHAPES = {"smollm2": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128)}
Case = tuple[tuple[Any, ...], float]  # (paged_attention's arguments less isa, multiply-adds)


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
    return (q, k, v, table, starts, seq, dim**-0.5, 0), macs


def prompt_case(heads: int, kv_heads: int, dim: int, n: int) -> Case:
    blocks = -(-n // 16)
    k, v = _cache(blocks, kv_heads, dim, 2)
    q = torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(3))
    table = torch.arange(blocks, dtype=torch.int32)[None]
    starts = torch.tensor([0, n], dtype=torch.int32)
    seq = torch.tensor([n], dtype=torch.int32)
    return (q, k, v, table, starts, seq, dim**-0.5, 0), n * (n + 1) / 2 * heads * dim * 2


def decode_case(heads: int, kv_heads: int, dim: int, batch: int, length: int) -> Case:
    blocks = -(-length // 16)
    k, v = _cache(blocks * batch, kv_heads, dim, 4)
    q = torch.randn(batch, heads, dim, generator=torch.Generator().manual_seed(5))
    table = torch.arange(blocks * batch, dtype=torch.int32).view(batch, blocks)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    seq = torch.full((batch,), length, dtype=torch.int32)
    return (q, k, v, table, starts, seq, dim**-0.5, 0), batch * length * heads * dim * 2


def cases() -> dict[str, Case]:
    out: dict[str, Case] = {}
    for model, shape in SHAPES.items():
        out[f"{model} burst step"] = burst_case(*shape)
        out[f"{model} prompt 512"] = prompt_case(*shape, 512)
        out[f"{model} decode 64 x 300"] = decode_case(*shape, 64, 300)
        out[f"{model} decode 1 x 256"] = decode_case(*shape, 1, 256)
        out[f"{model} decode 1 x 8192"] = decode_case(*shape, 1, 8192)
    return out


def compare(after: Any, before: Any, case: Case, isa: int, rounds: int) -> dict[str, Any]:
    args, macs = case
    same = torch.equal(after.paged_attention(*args, isa), before.paged_attention(*args, isa))
    t_after, t_before, ratios = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        before.paged_attention(*args, isa)
        t1 = time.perf_counter()
        after.paged_attention(*args, isa)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--only", default="", help="cases whose name holds this")
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
        for name, case in cases().items():
            if args.only not in name:
                continue
            for isa in range(after.isa(), 0, -1):
                row = {"case": name, **compare(after, before, case, isa, args.rounds)}
                print(row, flush=True)
                rows.append(row)
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
    if args.output_json:
        write_json(record, args.output_json)
    return 0 if all(r["bits_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
