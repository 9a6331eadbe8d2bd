"""The CPU sampler with race.cpp's race_sample against the torch path it replaced, at W-CPU's shape.

1. The Sampler alone: 64 rows of SmolLM2's 49,152-token vocabulary, temperature 0.6 (W-CPU's),
   float32 logits, median of --iters calls each way, alternating.
2. W-CPU end to end (`pagoda bench throughput -O2`, 64 requests, in/out U[16,256]), --rounds
   rounds in alternating order, each run in its own process: one as shipped, one with the race
   turned off (`pagoda.runner.sampler._race_kernel` patched to None: every row takes the torch
   path, as before race.cpp). Same workload, same tokens counted; the median ratio and its range.

    python benchmarks/sampler_race.py --rounds 3 --output-json benchmarks/results/issue42/part9/sampler_race.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.machine import machine_record, ratio_summary, round_order
from pagoda.runner.sampler import Sampler, SamplingMetadata

ROOT = Path(__file__).resolve().parents[1]
W_CPU = "-O2 --num-prompts 64 --input-len-range 16,256 --output-len-range 16,256".split()
SIDES = ("race", "torch_path")
KEPT = ("output_tok_s", "elapsed_s", "num_output_tokens", "num_preemptions")  # of each run
TORCH_PATH = "import pagoda.runner.sampler as s; s._race_kernel = lambda logits: None; "


def _meta(rows: int, temperature: float) -> SamplingMetadata:
    return SamplingMetadata(
        all_greedy=False,
        all_random=True,
        is_greedy=None,
        temperature=torch.full((rows,), temperature),
        top_k=None,
        top_p=None,
        min_p=None,
        presence_penalties=None,
        frequency_penalties=None,
        repetition_penalties=None,
        generators={},
        max_num_logprobs=None,
        max_top_k=0,
    )


def _time_sampler(logits: torch.Tensor, meta: SamplingMetadata, iters: int) -> float:
    for _ in range(3):
        Sampler()(logits, meta)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        Sampler()(logits, meta)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def sampler_alone(rows: int, vocab: int, iters: int) -> dict[str, Any]:
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab) * 3
    meta = _meta(rows, 0.6)
    race, plain = [], []
    for _ in range(3):
        race.append(_time_sampler(logits, meta, iters))
        os.environ["PAGODA_CPU_KERNELS"] = "0"
        try:
            plain.append(_time_sampler(logits, meta, iters))
        finally:
            del os.environ["PAGODA_CPU_KERNELS"]
    print(f"sampler alone: race {race} ms, torch path {plain} ms", file=sys.stderr)
    return {
        "shape": [rows, vocab],
        "temperature": 0.6,
        "race_ms": race,
        "torch_path_ms": plain,
        "speedup_median": statistics.median(p / r for p, r in zip(plain, race, strict=True)),
    }


def _wcpu(torch_path: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "w.json"
        argv = ["bench", "throughput", *W_CPU, "--output-json", str(out)]
        code = (TORCH_PATH if torch_path else "") + (
            f"import sys; from pagoda.cli import main; sys.exit(main({argv!r}))"
        )
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        pagoda = json.loads(out.read_text())["pagoda"]
    return {k: pagoda[k] for k in KEPT}


def wcpu_rounds(rounds: int) -> dict[str, Any]:
    entries: list[dict[str, Any]] = []
    for r in range(rounds):
        entry = {side: _wcpu(side == "torch_path") for side in round_order(r, SIDES)}
        print(f"round {r}: {entry}", file=sys.stderr)
        entries.append(entry)
    return {
        "command": "pagoda bench throughput " + " ".join(W_CPU),
        "order": "alternating rounds (race first in even rounds), each run in its own process",
        "rounds": entries,
        "ratio_output_tok_s": ratio_summary(
            [e["race"]["output_tok_s"] for e in entries],
            [e["torch_path"]["output_tok_s"] for e in entries],
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    record = {
        "bench": "sampler_race",
        "machine": machine_record(),
        "sampler_alone": sampler_alone(64, 49152, args.iters),
        "w_cpu": wcpu_rounds(args.rounds) if args.rounds > 0 else None,
    }
    text = json.dumps(record, indent=2)
    print(text)
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
