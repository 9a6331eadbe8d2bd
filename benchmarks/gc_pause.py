"""What a full collection of Python's cyclic garbage collector costs in an engine's process,
before and after the engine process's freeze of its startup heap
(engine/process.py freeze_startup_heap): build the engine (--model, -O2 by default), run one
short request, time --repeats full collections (`gc.collect()`), freeze, time them again.
A full collection pauses the step loop, so every running request's stream, for its length.

    python benchmarks/gc_pause.py --output-json benchmarks/results/gc_pause/smollm2.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from pagoda import LLM, SamplingParams
from pagoda.bench.common import write_json
from pagoda.bench.machine import machine_record, pagoda_version
from pagoda.engine.process import freeze_startup_heap


def _collections_ms(repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        times.append(round((time.perf_counter() - t0) * 1e3, 3))
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2)")
    p.add_argument("-O", "--optimization-level", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    llm = LLM(args.model, optimization_level=args.optimization_level)
    llm.generate([{"prompt_token_ids": [100, 200, 300]}], SamplingParams(max_tokens=4))
    tracked = len(gc.get_objects())
    before = _collections_ms(args.repeats)
    frozen = freeze_startup_heap()
    after = _collections_ms(args.repeats)
    record = {
        "bench": "gc_pause",
        "model": args.model or "SmolLM2-135M-Instruct (embedded Q4_1 GGUF)",
        "optimization_level": args.optimization_level,
        "tracked_objects_before": tracked,
        "full_collection_ms_before": before,
        "frozen_objects": frozen,
        "tracked_objects_after": len(gc.get_objects()),
        "full_collection_ms_after": after,
        "machine": machine_record(),
        "pagoda": pagoda_version(),
    }
    print(f"{tracked} objects: full collection {before} ms; {frozen} frozen: {after} ms")
    if args.output_json:
        write_json(record, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
