"""`bench throughput --enable-lora`: the workload with its requests spread over LoRA adapters
(bench/lora_adapters.py) against the same workload without adapters, the same tokens counted,
in alternating rounds (bench/machine.py says why); with --peer vllm, vLLM's LoRA on the same
adapters and vLLM without them in the same rounds.

Engines, every one up at once: `pagoda` (no LoRA flag), `pagoda-lora` (--enable-lora,
--max-loras defaulting to the number of adapters, so a step may run all of them), and per vLLM
precision `vllm-<dtype>` and `vllm-<dtype>-lora` (enable_lora with the same max_loras and
max_lora_rank). Every round draws new prompt tokens with the workload's lengths (prefix caches);
each engine takes the same requests, each request the same adapter on both LoRA engines.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from pagoda.bench.common import BenchRequest, log, median
from pagoda.bench.lora_adapters import (
    BenchAdapter,
    assign_adapters,
    lora_engine_kwargs,
    num_loras,
    prepare_adapters,
)
from pagoda.bench.machine import (
    machine_record,
    pagoda_version,
    ratio_summary,
    ratio_words,
    round_order,
)
from pagoda.bench.throughput_runs import fresh_tokens, start_pagoda, time_pagoda, warmup_requests
from pagoda.bench.vllm_peer import MEMORY_SHARE, PeerLoRA, VLLMPeer, vllm_dtypes, vllm_python

# issue 45's targets: pagoda with adapters over pagoda without them
TARGETS = {"throughput_output_tok_s": 0.8, "b1_decode_tok_s": 0.9}

# (name, runner(round index, that round's requests) -> the run's figures)
Runner = Callable[[int, list[BenchRequest]], dict[str, Any]]


def run_rounds(
    engines: dict[str, Runner], requests: list[BenchRequest], rounds: int, metric: str
) -> list[dict[str, Any]]:
    """Each round: fresh prompt tokens (round 0: the workload as drawn), every engine in the
    round's order (bench/machine.round_order)."""
    entries = []
    for r in range(rounds):
        work = fresh_tokens(requests, r)
        entry: dict[str, Any] = {"order": round_order(r, list(engines))}
        for name in entry["order"]:
            entry[name] = engines[name](r, work)
            log(f"round {r}: {name} {entry[name][metric]} {metric}")
        entries.append(entry)
    return entries


def ratio_pairs(dtypes: Sequence[str]) -> list[tuple[str, str]]:
    """The (numerator, denominator) engines a LoRA record compares: pagoda's LoRA cost first,
    then per vLLM precision vLLM's own LoRA cost, pagoda against vLLM with adapters and without."""
    pairs = [("pagoda-lora", "pagoda")]
    for d in dtypes:
        vllm = f"vllm-{d}"
        pairs += [(f"{vllm}-lora", vllm), ("pagoda-lora", f"{vllm}-lora"), ("pagoda", vllm)]
    return pairs


def summarize_ratios(
    record: dict[str, Any], pairs: list[tuple[str, str]], metric: str, label: str
) -> None:
    """record["ratios"][f"{a}/{b} {metric}"]: the round ratios' median and range; a line each in
    record["ratio_lines"], logged."""
    rounds = record["rounds"]
    ratios = record.setdefault("ratios", {})
    lines = record.setdefault("ratio_lines", [])
    for a, b in pairs:
        values = [[e[name].get(metric) for e in rounds] for name in (a, b)]
        summary = ratio_summary(values[0], values[1])
        ratios[f"{a} / {b} {metric}"] = summary
        lines.append(ratio_words(label, summary, b).replace("pagoda / ", f"{a} / ", 1))
        log(lines[-1])


def _medians(rounds: list[dict[str, Any]], engine: str, metric: str) -> dict[str, Any]:
    values = [e[engine][metric] for e in rounds]
    known = [v for v in values if v is not None]
    return {
        f"{metric}_median": round(median(known), 2) if known else None,
        f"{metric}_rounds": values,
    }


def lora_requests(adapters: list[BenchAdapter]) -> list[Any]:
    from pagoda.lora_request import LoRARequest

    return [LoRARequest(a.name, a.int_id, a.path) for a in adapters]


def vllm_lora_args(lora_kwargs: dict[str, Any]) -> dict[str, int]:
    """vLLM's LoRA engine arguments matching pagoda's."""
    out = {"max_loras": lora_kwargs["max_loras"], "max_lora_rank": lora_kwargs["max_lora_rank"]}
    if lora_kwargs.get("max_cpu_loras"):
        out["max_cpu_loras"] = lora_kwargs["max_cpu_loras"]
    return out


def start_vllm_peers(
    python: str, folder: str, dtypes: list[str], seed: int, max_len: int, lora: dict[str, int]
) -> dict[str, VLLMPeer]:
    """Per precision a vLLM engine without LoRA and one with it, all up at once (each with its
    share of MEMORY_SHARE); ones started are closed if a later one fails."""
    peers: dict[str, VLLMPeer] = {}
    share = MEMORY_SHARE / (2 * len(dtypes))
    try:
        for d in dtypes:
            peers[f"vllm-{d}"] = VLLMPeer(python, folder, d, seed, max_len, share)
            peers[f"vllm-{d}-lora"] = VLLMPeer(python, folder, d, seed, max_len, share, lora)
    except BaseException:
        for peer in peers.values():
            peer.close()
        raise
    return peers


def compare_lora_throughput(
    args: argparse.Namespace,
    kwargs: dict[str, Any],
    requests: list[BenchRequest],
    gguf_type: str | None,
) -> dict[str, Any]:
    """The record: machine, versions, the adapters and their shape, each round's runs, every
    engine's median, and the ratios' medians and ranges (ratio_pairs)."""
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if args.peer not in ("none", "vllm"):
        raise ValueError("--enable-lora runs with --peer none or --peer vllm")
    count = num_loras(args, kwargs, default=4)
    vllm = args.peer == "vllm"
    python = vllm_python(args.vllm_python) if vllm else ""
    machine = machine_record()
    dtypes = vllm_dtypes(args.vllm_dtype, machine["simd_flags"]) if vllm else []
    assignment = assign_adapters(len(requests), count, args.lora_assignment, args.seed)
    warm_assignment = assign_adapters(len(warmup_requests(requests)), count, "round-robin", 0)
    record: dict[str, Any] = {"machine": machine}
    with tempfile.TemporaryDirectory(prefix="pagoda-lora-bench-") as folder:
        adapters, lora = prepare_adapters(args, kwargs, folder, count, export_base=vllm)
        base_kwargs, lora_kwargs = lora_engine_kwargs(kwargs, count, int(lora["rank"]))
        lora.update(
            assignment=args.lora_assignment,
            requests_per_adapter=[assignment.count(i) for i in range(count)],
            engine_args=lora_kwargs,
        )
        record.update(engine_args=base_kwargs, lora=lora)
        loras = lora_requests(adapters)
        per_request = [loras[i] for i in assignment]
        max_len = max(len(r.prompt_token_ids) + r.output_len for r in requests)
        peers: dict[str, VLLMPeer] = {}
        if vllm:
            lora["vllm_engine_args"] = vllm_lora_args(lora_kwargs)
            peers = start_vllm_peers(
                python, folder, dtypes, args.seed, max_len, lora["vllm_engine_args"]
            )
        try:
            plan = {
                "loras": loras,
                "per_request": per_request,
                "warm": warm_assignment,
                "assignment": assignment,
                "adapters": adapters,
                "peers": peers,
            }
            engines, weights = _engines(args, requests, gguf_type, base_kwargs, lora_kwargs, plan)
            record["rounds"] = run_rounds(engines, requests, args.rounds, "output_tok_s")
        finally:
            for peer in peers.values():
                peer.close()
    _finish(record, weights, peers, dtypes, requests)
    return record


def _engines(
    args: argparse.Namespace,
    requests: list[BenchRequest],
    gguf_type: str | None,
    base_kwargs: dict[str, Any],
    lora_kwargs: dict[str, Any],
    plan: dict[str, Any],
) -> tuple[dict[str, Runner], dict[str, dict[str, Any]]]:
    """The runners of every engine (both pagoda engines started and warmed up here, the vLLM
    peers up already), and each pagoda engine's weight record."""
    model, temperature = args.model, args.temperature
    warm_loras = [plan["loras"][i] for i in plan["warm"]]
    llm, weights = start_pagoda(model, base_kwargs, requests, temperature, gguf_type)
    llm_lora, weights_lora = start_pagoda(
        model, lora_kwargs, requests, temperature, gguf_type, warm_loras
    )
    per_request = plan["per_request"]
    engines: dict[str, Runner] = {
        "pagoda": lambda r, work: time_pagoda(llm, work, temperature, progress=False),
        "pagoda-lora": lambda r, work: time_pagoda(
            llm_lora, work, temperature, progress=False, loras=per_request
        ),
    }
    rows = [(a.name, a.int_id, a.path) for a in plan["adapters"]]
    peer_lora = PeerLoRA(rows, plan["assignment"], plan["warm"])
    warm = warmup_requests(requests)

    def vllm_runner(peer: VLLMPeer, with_lora: bool) -> Runner:
        def run(r: int, work: list[BenchRequest]) -> dict[str, Any]:
            return peer.run(work, temperature, warm if r == 0 else [], peer_lora_for(r))

        def peer_lora_for(r: int) -> PeerLoRA | None:
            if not with_lora:
                return None
            return peer_lora if r == 0 else PeerLoRA(rows, plan["assignment"])

        return run

    for name, peer in plan["peers"].items():
        engines[name] = vllm_runner(peer, name.endswith("-lora"))
    return engines, {"pagoda": weights, "pagoda-lora": weights_lora}


def _finish(
    record: dict[str, Any],
    weights: dict[str, dict[str, Any]],
    peers: dict[str, VLLMPeer],
    dtypes: list[str],
    requests: list[BenchRequest],
) -> None:
    rounds = record["rounds"]
    metric = "output_tok_s"
    record["pagoda"] = {**weights["pagoda"], **_medians(rounds, "pagoda", metric)}
    record["pagoda_lora"] = {**weights["pagoda-lora"], **_medians(rounds, "pagoda-lora", metric)}
    record["peers"] = {
        name: {**p.info, **_medians(rounds, name, metric)} for name, p in peers.items()
    }
    record["versions"] = {"pagoda": pagoda_version(), **{n: p.info for n, p in peers.items()}}
    record["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    want = sum(r.output_len for r in requests)
    counted = {name: [e[name]["num_output_tokens"] for e in rounds] for name in rounds[0]["order"]}
    record["num_output_tokens"] = counted
    record["same_tokens_counted"] = all(n == want for ns in counted.values() for n in ns)
    if not record["same_tokens_counted"]:
        log(f"warning: not every run produced the workload's {want} output tokens: {counted}")
    summarize_ratios(record, ratio_pairs(dtypes), metric, "output tok/s")
    key = "pagoda-lora / pagoda output_tok_s"
    record["target"] = {
        "ratio": key,
        "at_least": TARGETS["throughput_output_tok_s"],
        "met": (record["ratios"][key]["median"] or 0) >= TARGETS["throughput_output_tok_s"],
    }
