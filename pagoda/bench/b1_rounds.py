"""`bench latency --peer llama-bench`: pagoda's B1 against native llama-bench in alternating
rounds (bench/machine.py says why), on the same GGUF file with the same prompt and output
lengths.

pagoda stays up across the rounds (its startup and warm-up are not timed, as llama-bench's model
load and warm-up run are not); each round times --num-iters fresh random prompts on pagoda and
llama-bench's --num-iters repetitions of each test (bench/llama_bench.py). The figures compared:
- decode tok/s: pagoda's rate after the first token against tgM @ dN;
- prefill tok/s: pagoda's prompt tokens over its time to first token (sampling the first token
  and streaming it back included) against ppN.
The roofline line uses pagoda's median decode step over the rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
from typing import Any

from pagoda.bench.b1_runs import IterTiming, start_pagoda, time_prompt
from pagoda.bench.common import gguf_path, log, median, random_prompt
from pagoda.bench.llama_bench import llama_bench_round, llama_cpp_bin
from pagoda.bench.machine import (
    machine_record,
    pagoda_version,
    ratio_summary,
    ratio_words,
    round_order,
)
from pagoda.bench.roofline import roofline, roofline_line

ENGINES = ("pagoda", "llama-bench")


def compare_with_llama_bench(
    args: argparse.Namespace, kwargs: dict[str, Any], gguf_type: str | None
) -> dict[str, Any]:
    """The record: machine, versions, each round's figures on both sides, the ratios' medians
    and ranges, and pagoda's roofline line."""
    if args.workload != "random" or "speculative_config" in kwargs:
        raise ValueError("--peer llama-bench runs the random workload without speculation")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    tool = llama_cpp_bin(args.llama_cpp_bin, "llama-bench")
    path = gguf_path(args.model)
    if path is None:
        raise ValueError("--peer llama-bench needs a GGUF model")
    record: dict[str, Any] = {"machine": machine_record(), "rounds": []}
    llm, weights = start_pagoda(args.model, kwargs, gguf_type)
    seeds = itertools.count(args.seed)  # a fresh prompt each time: no prefix-cache hit
    for _ in range(args.num_iters_warmup):
        time_prompt(llm, random_prompt(args.input_len, next(seeds)), args.output_len)
    outputs: list[list[int]] = []
    for r in range(args.rounds):
        entry: dict[str, Any] = {"order": round_order(r, ENGINES)}
        for engine in entry["order"]:
            if engine == "pagoda":
                prompts = [
                    random_prompt(args.input_len, next(seeds)) for _ in range(args.num_iters)
                ]
                entry["pagoda"] = _pagoda_round(llm, prompts, args, outputs)
            else:
                entry["llama-bench"] = llama_bench_round(
                    tool, path, args.input_len, args.output_len, args.num_iters
                )
        record["rounds"].append(entry)
    _summarize_rounds(record, args)
    decode_ms = 1e3 / median([e["pagoda"]["decode_tok_s"] for e in record["rounds"]])
    record["roofline"] = roofline(llm, args.input_len, args.output_len, round(decode_ms, 3), path)
    log(roofline_line(record["roofline"]))
    record["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    record["versions"] = {
        "pagoda": pagoda_version(),
        "llama-bench": record["rounds"][0]["llama-bench"]["version"],
    }
    record["pagoda_weights"] = weights
    record["pagoda_outputs_sha256"] = hashlib.sha256(repr(outputs).encode()).hexdigest()
    return record


def _pagoda_round(
    llm: Any, prompts: list[list[int]], args: argparse.Namespace, outputs: list[list[int]]
) -> dict[str, Any]:
    timings: list[IterTiming] = []
    for ids in prompts:
        timing, tokens = time_prompt(llm, ids, args.output_len)
        timings.append(timing)
        outputs.append(tokens)
    rates = [t.decode_tok_s for t in timings if t.decode_tok_s is not None]
    ttft = median([t.ttft_s for t in timings])
    log(f"pagoda: prefill {args.input_len / ttft:.1f} tok/s, decode {median(rates):.1f} tok/s")
    return {
        "prefill_tok_s": round(args.input_len / ttft, 2),
        "ttft_ms": round(ttft * 1e3, 2),
        "decode_tok_s": round(median(rates), 2),
        "iters_decode_tok_s": [round(r, 2) for r in rates],
        "iters_ttft_ms": [round(t.ttft_s * 1e3, 2) for t in timings],
    }


def _summarize_rounds(record: dict[str, Any], args: argparse.Namespace) -> None:
    rounds = record["rounds"]
    lines = []
    for metric, label in (
        ("decode_tok_s", f"decode tok/s (tg{args.output_len} @ d{args.input_len})"),
        ("prefill_tok_s", f"prefill tok/s (pp{args.input_len})"),
    ):
        summary = ratio_summary(
            [e["pagoda"][metric] for e in rounds], [e["llama-bench"][metric] for e in rounds]
        )
        record[f"ratio_{metric}"] = summary
        for side in ENGINES:
            record[f"{side}_{metric}_median"] = round(median([e[side][metric] for e in rounds]), 2)
        lines.append(ratio_words(label, summary, "native llama.cpp"))
    record["ratio_lines"] = lines
    for line in lines:
        log(line)
