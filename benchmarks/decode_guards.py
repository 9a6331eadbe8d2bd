"""The compiled decode step's guard check, and what it costs a step, with and without guards on
the model's modules, in one process.

compilation.py compiles two graphs (batch 1, batch >= 2) with guard_filter_fn skipping the
guards on the model's modules. torch.compile pops guard_filter_fn from the options dict it is
given, and both graphs were compiled with one dict, so until this script's commit the batch >= 2
graph kept every module guard (some 6,600 lines of guard tree for SmolLM2). Here two engines
on the same GGUF, compiled at -O2: "filtered" as the tree compiles them, "unfiltered" with its
batch >= 2 graph compiled without the filter (the old behaviour). For each batch size, each
engine decodes that many requests (128-token random prompts, greedy, EOS ignored) in turn, the
order alternating over --rounds; each step's guard check is timed apart (the same check the
runner makes before calling a graph's code).

    python benchmarks/decode_guards.py --rounds 5 --output-json guards.json

Prints one line per round and batch; the JSON holds each batch's median step time and guard
check per engine and the median ratio unfiltered / filtered of the step times.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.common import write_json
from pagoda.bench.machine import machine_record, pagoda_version
from pagoda.runner import compilation
from pagoda.scheduling.messages import EngineRequest

BATCHES = (1, 2, 8, 32, 64)
PROMPT = 128


def engine_args(steps: int) -> dict[str, Any]:
    """-O2, and a KV cache of what the largest batch needs (two engines at the default 2 GiB
    each, faulted in, are more memory than a test run beside others should take)."""
    blocks = max(BATCHES) * -(-(PROMPT + steps + 8) // 16) + 64
    return {
        "optimization_level": 2,
        "enable_prefix_caching": False,
        "num_gpu_blocks_override": blocks,
    }


def unfiltered_llm(model: str | None, steps: int) -> LLM:
    """An engine whose batch >= 2 graph keeps its module guards, as before the fix."""
    init = compilation._Dispatch.__init__

    def without_filter(self: Any, fn: Any, options: Any, backend: str = "inductor") -> None:
        if fn.__name__.startswith("_decode_many"):
            options = {k: v for k, v in options.items() if k != "guard_filter_fn"}
        init(self, fn, options, backend)

    compilation._Dispatch.__init__ = without_filter  # type: ignore[method-assign]
    try:
        return LLM(model, **engine_args(steps))
    finally:
        compilation._Dispatch.__init__ = init  # type: ignore[method-assign]


def guard_lines(llm: LLM) -> dict[str, int]:
    compiled = llm.engine.executor.runner.compiled
    lines = {}
    for dispatch in (compiled._one, compiled._many):
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(dispatch.fn.__code__)
        lines[dispatch.fn.__name__.rsplit("_", 1)[0]] = sum(
            len(str(e.guard_manager).splitlines()) for e in entries
        )
    return lines


def timed_steps(llm: LLM, batch: int, steps: int, seed: int) -> tuple[float, float]:
    """(median step ms, median guard-check ms) over `steps` decode steps of `batch` requests."""
    engine = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(100, 20000) for _ in range(PROMPT)]
        engine.add_request(EngineRequest(f"r{seed}-{i}", prompt, params))
    while any(len(r.output_token_ids) < 2 for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()  # the prefills, and a first decode step each
    checks: list[float] = []
    dispatch = engine.executor.runner.compiled._graph(torch.zeros(batch))
    check, code = dispatch.entries[0]

    def timed_check(frame: dict[str, Any]) -> bool:
        t0 = time.perf_counter()
        ok = check(frame)
        checks.append(time.perf_counter() - t0)
        return ok

    dispatch.entries[0] = (timed_check, code)
    walls = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    finally:
        dispatch.entries[0] = (check, code)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(walls) * 1e3, statistics.median(checks) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: embedded SmolLM2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    engines = {
        "filtered": LLM(args.model, **engine_args(args.steps)),
        "unfiltered": unfiltered_llm(args.model, args.steps),
    }
    lines = {name: guard_lines(llm) for name, llm in engines.items()}
    print(f"guard tree lines: {lines}", flush=True)
    runs: dict[int, list[dict[str, Any]]] = {int(b): [] for b in args.batches.split(",")}
    for r in range(args.rounds):
        for batch in runs:
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            row: dict[str, Any] = {"round": r}
            for name in order:
                step_ms, guard_ms = timed_steps(engines[name], batch, args.steps, r)
                row[name] = {"step_ms": round(step_ms, 3), "guard_ms": round(guard_ms, 4)}
            row["unfiltered_over_filtered"] = round(
                row["unfiltered"]["step_ms"] / row["filtered"]["step_ms"], 3
            )
            print(f"batch {batch}: {row}", flush=True)
            runs[batch].append(row)
    summary = {
        str(batch): {
            name: {
                "step_ms": statistics.median(x[name]["step_ms"] for x in rows),
                "guard_ms": statistics.median(x[name]["guard_ms"] for x in rows),
            }
            for name in engines
        }
        | {
            "unfiltered_over_filtered_median": statistics.median(
                x["unfiltered_over_filtered"] for x in rows
            ),
            "range": [
                min(x["unfiltered_over_filtered"] for x in rows),
                max(x["unfiltered_over_filtered"] for x in rows),
            ],
        }
        for batch, rows in runs.items()
    }
    record = {
        "benchmark": "decode_guards",
        "method": (
            "two -O2 engines in one process, the batch >= 2 graph compiled with and without the "
            "module-guard filter; each batch size decoded by each in turn, the order alternating "
            "per round; step = engine.step() wall time, guard = the graph entry's check alone"
        ),
        "model": args.model or "embedded SmolLM2",
        "guard_tree_lines": lines,
        "steps_per_run": args.steps,
        "rounds": args.rounds,
        "pagoda": pagoda_version(),
        "machine": machine_record(),
        "summary": summary,
        "runs": {str(b): rows for b, rows in runs.items()},
    }
    if args.output_json:
        write_json(record, args.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
