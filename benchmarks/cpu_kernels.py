"""pagoda's CPU kernels (pagoda/kernels/cpu) against torch's quantized CPU ops, the ones pagoda
runs without them, on SmolLM2-135M's layer shapes, the paged decode attention against the
compiled reductions, and a decode A/B on the whole model.

1. Matmuls, one layer at a time: 4-bit groups (GGUF Q4_1's form; torch: _weight_int4pack_mm
   with bf16 activations) and int8 rows (the LM head; torch: _weight_int8pack_mm), for 1 to 256
   rows (decode steps to prefill chunks); median microseconds of --repeats timings, and the
   weight bytes read per microsecond against this machine's read bandwidth (a float32 sum over
   1 GiB, measured here).
2. Decode on the embedded SmolLM2 GGUF, eager (-O0): two engines, one on the kernels' forms and
   one on torch's (PAGODA_CPU_KERNELS=0 when it loads), alternately, --rounds each; decode tok/s
   and whether the greedy tokens agree.

    python benchmarks/cpu_kernels.py \\
        --output-json benchmarks/results/issue22/cpu_kernels.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from pagoda.bench.common import write_json
from pagoda.bench.roofline import read_bandwidth_gb_s
from pagoda.kernels.cpu import ISA_NAMES, built
from pagoda.layers.cpu_forms import pack_q4x16, pack_q8x16
from pagoda.layers.quant_forms import int4_matmul, int4_pack, int8_matmul, quantize_int8_rows

# SmolLM2-135M: (name, N, K) of its linears (q/k/v packed, gate/up packed) and its head
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
HEAD = ("lm_head", 49152, 576)
ROWS = (1, 2, 4, 8, 16, 64, 256)


def median_us(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def matmuls(ops: Any, repeats: int, bandwidth: float) -> list[dict[str, Any]]:
    out = []
    gen = torch.Generator().manual_seed(0)
    for name, n, k in SHAPES:
        g = k // 32
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        scale, offset = torch.rand(n, g, generator=gen) * 0.02, torch.randn(n, g, generator=gen)
        packed, tiles = int4_pack(codes, scale, offset), pack_q4x16(codes, scale, offset)
        ours_bytes = tiles.numel()  # codes, fp16 scales and offsets
        out.append(_cold(ops, name, n, k, codes, scale, offset, repeats, bandwidth))
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            ours = median_us(lambda: ops.q4x16_matmul(x, tiles, n, 2, 0), repeats)  # noqa: B023
            theirs = median_us(lambda: int4_matmul(x, *packed, 32), repeats)  # noqa: B023
            out.append(_row(name, "4-bit groups", n, k, m, ours, theirs, ours_bytes, bandwidth))
    name, n, k = HEAD
    codes8, scale8 = quantize_int8_rows(torch.randn(n, k, generator=gen))
    bf16, tiles8 = scale8.to(torch.bfloat16), pack_q8x16(codes8, scale8[:, None])
    for m in ROWS[:6]:
        x = torch.randn(m, k, generator=gen)
        ours = median_us(lambda: ops.q8x16_matmul(x, *tiles8, n, 2), repeats // 5)  # noqa: B023
        theirs = median_us(lambda: int8_matmul(x, codes8, bf16), repeats // 5)  # noqa: B023
        out.append(_row(name, "int8 rows", n, k, m, ours, theirs, codes8.numel(), bandwidth))
    return out


def _cold(
    ops: Any,
    name: str,
    n: int,
    k: int,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    repeats: int,
    bandwidth: float,
) -> dict[str, Any]:
    """One row, the weights streamed from memory as in a decode step: each call reads the next
    of enough copies to overflow the caches (256 MB of them)."""
    first = pack_q4x16(codes, scale, offset)
    ours_bytes = first.numel()  # codes, fp16 scales and offsets
    copies = max(2, 256 * 2**20 // ours_bytes)
    tiles = [first] + [first.clone() for _ in range(copies - 1)]
    packs = [int4_pack(codes, scale, offset) for _ in range(copies)]
    x = torch.randn(1, k)
    turn = iter(range(10**9))
    ours = median_us(lambda: ops.q4x16_matmul(x, tiles[next(turn) % copies], n, 2, 0), repeats)
    theirs = median_us(lambda: int4_matmul(x, *packs[next(turn) % copies], 32), repeats)
    torch_bytes = n * k // 2 + 4 * scale.numel()  # bf16 scale and zero
    row = _row(f"{name} cold", "4-bit groups", n, k, 1, ours, theirs, ours_bytes, bandwidth)
    row["torch_gb_s"] = round(torch_bytes / theirs / 1e3, 1)
    return row


def _row(
    name: str, form: str, n: int, k: int, m: int, ours: float, theirs: float, nbytes: int, bw: float
) -> dict[str, Any]:
    row = {
        "layer": name,
        "form": form,
        "N": n,
        "K": k,
        "rows": m,
        "pagoda_us": round(ours, 1),
        "torch_us": round(theirs, 1),
        "speedup": round(theirs / ours, 2),
        "weight_bytes": nbytes,
        "pagoda_gb_s": round(nbytes / ours / 1e3, 1),
        "fraction_of_bandwidth": round(nbytes / ours / 1e3 / bw, 3),
    }
    print(
        f"{name:8s} {form:13s} rows {m:3d}: pagoda {ours:8.1f} us, torch {theirs:8.1f} us, "
        f"x{theirs / ours:4.2f}, {row['pagoda_gb_s']:5.1f} GB/s",
        flush=True,
    )
    return row


def decode_step_matmuls(ops: Any, repeats: int, bandwidth: float) -> dict[str, Any]:
    """The 4-bit matmuls of one batch-1 decode step (30 layers of SmolLM2's four, each its own
    weights, so they stream from memory as in the model): milliseconds and bytes per second."""
    gen = torch.Generator().manual_seed(1)
    layers = []
    for _ in range(30):
        for _, n, k in SHAPES:
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
            scale = torch.rand(n, k // 32, generator=gen) * 0.02
            tiles = pack_q4x16(codes, scale, torch.randn(n, k // 32, generator=gen))
            layers.append((torch.randn(1, k, generator=gen), tiles, n))
    nbytes = sum(t.numel() for _, t, _ in layers)
    us = median_us(
        lambda: [ops.q4x16_matmul(x, t, n, 2, 0) for x, t, n in layers], max(5, repeats // 5)
    )
    row = {
        "weight_mb": round(nbytes / 1e6, 1),
        "step_ms": round(us / 1e3, 3),
        "gb_s": round(nbytes / us / 1e3, 1),
        "fraction_of_bandwidth": round(nbytes / us / 1e3 / bandwidth, 3),
    }
    print(f"4-bit matmuls of a decode step: {row}", flush=True)
    return row


def decode_attention(ops: Any, repeats: int) -> list[dict[str, Any]]:
    """paged_decode_attention against the compiled reductions that -O2 ran before it
    (layers/attention.py: decode_attention_reductions), 30 layers' float32 caches of SmolLM2's
    shape, requests of 32-300 positions on scattered blocks, a 64 MB write between timings so
    the caches come from memory as in a step."""
    from pagoda.kernels.paged_cache import KVCache
    from pagoda.layers.attention import decode_attention_reductions

    gen = torch.Generator().manual_seed(2)
    blocks, width = 1200, 19
    caches = []
    for _ in range(30):
        cache = KVCache.allocate(2912, 16, 3, 64, torch.float32, None, "cpu")
        cache.k[:blocks].normal_(generator=gen)
        cache.v[:blocks].normal_(generator=gen)
        caches.append(cache)
    evict = torch.ones(16 * 2**20)
    reductions = torch.compile(decode_attention_reductions, fullgraph=True, dynamic=True)
    rows = []
    for batch in (1, 4, 16):
        lens = torch.randint(32, 301, (batch,), generator=gen, dtype=torch.int32)
        perm = torch.randperm(blocks, generator=gen)[: batch * width].view(batch, width)
        tables = perm.to(torch.int32).contiguous()
        q = torch.randn(batch, 9, 64, generator=gen)

        def kernel() -> None:
            for c in caches:
                ops.paged_decode_attention(q, c.k, c.v, tables, lens, 0.125, 0, 2)  # noqa: B023

        def compiled() -> None:
            for c in caches:
                reductions(q, c, tables, lens, 0.125)  # noqa: B023

        def cold(fn: Callable[[], None]) -> float:
            fn()
            times = []
            for _ in range(max(5, repeats // 5)):
                evict.add_(1.0)
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times) * 1e3

        ours, theirs = cold(kernel), cold(compiled)
        rows.append(
            {
                "batch": batch,
                "positions": lens.tolist() if batch <= 4 else int(lens.sum()),
                "kernel_ms_30_layers": round(ours, 3),
                "compiled_reductions_ms_30_layers": round(theirs, 3),
                "speedup": round(theirs / ours, 2),
            }
        )
        print(f"decode attention: {rows[-1]}", flush=True)
    return rows


def decode_ab(rounds: int, max_tokens: int) -> dict[str, Any]:
    from pagoda import LLM, SamplingParams

    engines = {}
    for side, enabled in (("kernels", "1"), ("torch", "0")):
        os.environ["PAGODA_CPU_KERNELS"] = enabled  # read as the layers load
        engines[side] = LLM(optimization_level=0, num_gpu_blocks_override=64, max_model_len=512)
    os.environ["PAGODA_CPU_KERNELS"] = "1"
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 228))}
    rates: dict[str, list[float]] = {"torch": [], "kernels": []}
    tokens: dict[str, list[int]] = {}
    for r in range(rounds + 1):  # round 0 warms both up, untimed
        for side in ("kernels", "torch") if r % 2 == 0 else ("torch", "kernels"):
            out = engines[side].generate([prompt], params, use_tqdm=False)[0]
            m = out.metrics
            if r > 0:
                rates[side].append((max_tokens - 1) / (m.last_token_time - m.first_token_time))
            tokens[side] = list(out.outputs[0].token_ids)
    plain, ours = statistics.median(rates["torch"]), statistics.median(rates["kernels"])
    return {
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF kept quantized, -O0, batch 1, 128-token prompt",
        "decode_tok_s_torch_ops": [round(x, 2) for x in rates["torch"]],
        "decode_tok_s_cpu_kernels": [round(x, 2) for x in rates["kernels"]],
        "median_torch_ops": round(plain, 2),
        "median_cpu_kernels": round(ours, 2),
        "ratio": round(ours / plain, 3),
        "same_greedy_tokens": tokens["torch"] == tokens["kernels"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    ops = built()
    if ops is None or os.environ.get("PAGODA_CPU_KERNELS") == "0":
        print(
            "needs the CPU kernels: a C++ compiler, and PAGODA_CPU_KERNELS not 0", file=sys.stderr
        )
        return 1
    bandwidth = read_bandwidth_gb_s(torch.device("cpu"))
    print(f"read bandwidth {bandwidth:.1f} GB/s; kernels: {ISA_NAMES[ops.isa()]}", flush=True)
    record = {
        "bench": "cpu_kernels",
        "note": "pagoda's C++ kernels (int8 activations per group of 32) against torch's CPU "
        "quantized ops (bf16 activations), same weights; median of repeated timings; "
        f"{torch.get_num_threads()} threads",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "isa": ISA_NAMES[ops.isa()],
        "read_bandwidth_gb_s": round(bandwidth, 1),
        "matmuls": matmuls(ops, args.repeats, bandwidth),
        "decode_step_4bit_matmuls": decode_step_matmuls(ops, args.repeats, bandwidth),
        "decode_attention": decode_attention(ops, args.repeats),
        "decode_ab": decode_ab(args.rounds, args.max_tokens),
    }
    print(record["decode_ab"], flush=True)
    if args.output_json:
        write_json(record, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
